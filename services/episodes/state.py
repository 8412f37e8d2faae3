"""Join state of the episode builder: traces waiting for verdicts, verdicts waiting for traces,
and each episode's reward components. Redis in the service (survives a restart of the builder),
a dict in tests and the in-memory default."""

from __future__ import annotations

import abc

from schemas.base import decode
from schemas.episode import RewardComponent
from schemas.trace import Trace
from schemas.verdict import Verdict


class JoinStore(abc.ABC):
    """Where the builder keeps what it has seen but could not finish yet."""

    @abc.abstractmethod
    async def put_trace(self, trace: Trace) -> None: ...

    @abc.abstractmethod
    async def get_trace(self, trace_id: str) -> Trace | None: ...

    @abc.abstractmethod
    async def add_pending(self, verdict: Verdict) -> None:
        """Keep a verdict whose trace has not arrived yet."""

    @abc.abstractmethod
    async def pending(self, trace_id: str) -> list[Verdict]:
        """The verdicts waiting for ``trace_id`` (kept until :meth:`drop_pending`)."""

    @abc.abstractmethod
    async def drop_pending(self, trace_id: str, verdict_ids: list[str]) -> None:
        """Forget verdicts once their episode is out (after, not before: a crash in between
        must leave them to be joined again)."""

    @abc.abstractmethod
    async def set_primary(self, episode_id: str, verdict: Verdict) -> Verdict:
        """The episode's first verdict (its assistant turn): set once, returned ever after."""

    @abc.abstractmethod
    async def add_component(self, episode_id: str, component: RewardComponent) -> list[RewardComponent]:
        """Add a component unless one of that name exists; returns all of the episode's components."""

    async def intact(self) -> bool:
        """False once the store lost what it held since :meth:`arm` (Redis flushed or restarted empty)."""
        return True

    async def arm(self) -> None:
        """Mark the state as complete (after a start or a rebuild): its loss shows in :meth:`intact`."""

    async def close(self) -> None:
        """Release connections."""


class MemoryJoinStore(JoinStore):
    """In-process state (lost on exit)."""

    def __init__(self) -> None:
        self.traces: dict[str, Trace] = {}
        self.waiting: dict[str, list[Verdict]] = {}
        self.primary: dict[str, Verdict] = {}
        self.components: dict[str, dict[str, RewardComponent]] = {}

    async def put_trace(self, trace: Trace) -> None:
        self.traces[trace.trace_id] = trace

    async def get_trace(self, trace_id: str) -> Trace | None:
        return self.traces.get(trace_id)

    async def add_pending(self, verdict: Verdict) -> None:
        self.waiting.setdefault(verdict.trace_id, []).append(verdict)

    async def pending(self, trace_id: str) -> list[Verdict]:
        return list(self.waiting.get(trace_id, []))

    async def drop_pending(self, trace_id: str, verdict_ids: list[str]) -> None:
        left = [v for v in self.waiting.get(trace_id, []) if v.verdict_id not in verdict_ids]
        if left:
            self.waiting[trace_id] = left
        else:
            self.waiting.pop(trace_id, None)

    async def set_primary(self, episode_id: str, verdict: Verdict) -> Verdict:
        return self.primary.setdefault(episode_id, verdict)

    async def add_component(self, episode_id: str, component: RewardComponent) -> list[RewardComponent]:
        comps = self.components.setdefault(episode_id, {})
        comps.setdefault(component.name, component)
        return list(comps.values())


class RedisJoinStore(JoinStore):
    """State in Redis under ``prefix``; traces expire after ``trace_ttl_s`` (unsampled ones never join)."""

    def __init__(self, url: str, prefix: str, trace_ttl_s: int) -> None:
        import redis.asyncio as redis

        self.r = redis.Redis.from_url(url)
        self.p = prefix
        self.ttl = trace_ttl_s
        self.intact_key = f"{prefix}:join-intact"

    async def intact(self) -> bool:
        return bool(await self.r.exists(self.intact_key))

    async def arm(self) -> None:
        await self.r.set(self.intact_key, b"1")

    async def put_trace(self, trace: Trace) -> None:
        await self.r.set(f"{self.p}:trace:{trace.trace_id}", trace.to_bytes(), ex=self.ttl)

    async def get_trace(self, trace_id: str) -> Trace | None:
        raw = await self.r.get(f"{self.p}:trace:{trace_id}")
        return None if raw is None else decode(Trace, raw)

    async def add_pending(self, verdict: Verdict) -> None:
        await self.r.hset(f"{self.p}:pending:{verdict.trace_id}", verdict.verdict_id, verdict.to_bytes())

    async def pending(self, trace_id: str) -> list[Verdict]:
        raw = await self.r.hgetall(f"{self.p}:pending:{trace_id}")
        return [decode(Verdict, v) for _, v in sorted(raw.items())]

    async def drop_pending(self, trace_id: str, verdict_ids: list[str]) -> None:
        if verdict_ids:
            await self.r.hdel(f"{self.p}:pending:{trace_id}", *verdict_ids)

    async def set_primary(self, episode_id: str, verdict: Verdict) -> Verdict:
        key = f"{self.p}:primary:{episode_id}"
        await self.r.set(key, verdict.to_bytes(), nx=True)
        return decode(Verdict, await self.r.get(key))

    async def add_component(self, episode_id: str, component: RewardComponent) -> list[RewardComponent]:
        key = f"{self.p}:components:{episode_id}"
        await self.r.hsetnx(key, component.name, component.to_bytes())
        return [decode(RewardComponent, v) for _, v in sorted((await self.r.hgetall(key)).items())]

    async def close(self) -> None:
        await self.r.aclose()
