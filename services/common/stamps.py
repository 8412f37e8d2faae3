"""Adapter state in Redis: the version stamp per model id, the promoted version, and which sampler
serves which version (with a TTL).

The publisher writes stamps and promotions; the gateway follows the promoted key; samplers report
what they serve; the trainer reads the stamp for staleness. ``memory://`` keeps it in process.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Callable


def stamp_key(namespace: str, model_id: str) -> str:
    """Redis key of the adapter version stamp (the trainer reads it for staleness)."""
    return f"fanroute:{namespace}adapter:stamp:{model_id}"


def promoted_key(namespace: str, model_id: str) -> str:
    """Redis key of the promoted version: JSON ``{"version": v, "fallback_provider": p}``."""
    return f"fanroute:{namespace}adapter:promoted:{model_id}"


def _serving_prefix(namespace: str, model_id: str) -> str:
    return f"fanroute:{namespace}adapter:serving:{model_id}"


#: KEYS[1] = max(KEYS[1], ARGV[1]), atomically; returns the value.
RAISE_TO = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if current < wanted then redis.call('SET', KEYS[1], wanted); return wanted end
return current
"""


class StampStore(abc.ABC):
    """Version stamps per model id, and which sampler serves which version (with a TTL)."""

    @abc.abstractmethod
    async def incr(self, model_id: str) -> int:
        """Move the stamp on by one and return it: the new version number."""

    @abc.abstractmethod
    async def raise_to(self, model_id: str, version: int) -> int:
        """Set the stamp to ``version`` unless it is already at least that (atomic); returns the stamp.
        How a publisher restores a stamp Redis lost: version numbers never restart under a name."""

    @abc.abstractmethod
    async def get(self, model_id: str) -> int:
        """The current stamp (0 before the first publish)."""

    @abc.abstractmethod
    async def set_promoted(self, model_id: str, version: int, fallback_provider: str | None) -> None:
        """Record the promoted version (what routed gateways poll)."""

    @abc.abstractmethod
    async def promoted(self, model_id: str) -> tuple[int, str | None] | None:
        """(version, fallback provider) of the promoted version, or None."""

    @abc.abstractmethod
    async def report_serving(self, model_id: str, sampler_id: str, version: int, ttl_s: float) -> None:
        """Record that ``sampler_id`` serves ``version`` for the next ``ttl_s`` seconds."""

    @abc.abstractmethod
    async def serving(self, model_id: str) -> dict[str, int]:
        """sampler id → version, for reports that have not expired."""

    async def close(self) -> None:
        """Release connections."""


class MemoryStampStore(StampStore):
    """In-process stamps (lost on exit): unit tests and the embedded default."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.stamps: dict[str, int] = {}
        self.reports: dict[str, dict[str, tuple[int, float]]] = {}
        self.promotions: dict[str, tuple[int, str | None]] = {}

    async def incr(self, model_id: str) -> int:
        self.stamps[model_id] = self.stamps.get(model_id, 0) + 1
        return self.stamps[model_id]

    async def raise_to(self, model_id: str, version: int) -> int:
        self.stamps[model_id] = max(self.stamps.get(model_id, 0), version)
        return self.stamps[model_id]

    async def get(self, model_id: str) -> int:
        return self.stamps.get(model_id, 0)

    async def set_promoted(self, model_id: str, version: int, fallback_provider: str | None) -> None:
        self.promotions[model_id] = (version, fallback_provider)

    async def promoted(self, model_id: str) -> tuple[int, str | None] | None:
        return self.promotions.get(model_id)

    async def report_serving(self, model_id: str, sampler_id: str, version: int, ttl_s: float) -> None:
        self.reports.setdefault(model_id, {})[sampler_id] = (version, self.clock() + ttl_s)

    async def serving(self, model_id: str) -> dict[str, int]:
        now = self.clock()
        return {s: v for s, (v, until) in self.reports.get(model_id, {}).items() if until > now}


class RedisStampStore(StampStore):
    """Stamps as Redis counters; serving reports as a set of sampler ids plus one key each with a TTL."""

    def __init__(self, url: str, namespace: str) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.namespace = namespace

    async def incr(self, model_id: str) -> int:
        return int(await self.client.incr(stamp_key(self.namespace, model_id)))

    async def raise_to(self, model_id: str, version: int) -> int:
        return int(await self.client.eval(RAISE_TO, 1, stamp_key(self.namespace, model_id), version))

    async def get(self, model_id: str) -> int:
        return int(await self.client.get(stamp_key(self.namespace, model_id)) or 0)

    async def set_promoted(self, model_id: str, version: int, fallback_provider: str | None) -> None:
        value = json.dumps({"version": version, "fallback_provider": fallback_provider})
        await self.client.set(promoted_key(self.namespace, model_id), value)

    async def promoted(self, model_id: str) -> tuple[int, str | None] | None:
        return parse_promoted(await self.client.get(promoted_key(self.namespace, model_id)))

    async def report_serving(self, model_id: str, sampler_id: str, version: int, ttl_s: float) -> None:
        prefix = _serving_prefix(self.namespace, model_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(f"{prefix}:{sampler_id}", version, px=int(ttl_s * 1000))
            pipe.sadd(f"{prefix}:samplers", sampler_id)
            await pipe.execute()

    async def serving(self, model_id: str) -> dict[str, int]:
        prefix = _serving_prefix(self.namespace, model_id)
        samplers = sorted(s.decode() for s in await self.client.smembers(f"{prefix}:samplers"))
        if not samplers:
            return {}
        values = await self.client.mget([f"{prefix}:{s}" for s in samplers])
        expired = [s for s, v in zip(samplers, values) if v is None]
        if expired:
            await self.client.srem(f"{prefix}:samplers", *expired)
        return {s: int(v) for s, v in zip(samplers, values) if v is not None}

    async def close(self) -> None:
        await self.client.aclose()


def parse_promoted(raw: bytes | str | None) -> tuple[int, str | None] | None:
    """The promoted key's value as (version, fallback provider); None when unset."""
    if raw is None:
        return None
    data = json.loads(raw)
    return int(data["version"]), data.get("fallback_provider")


def stamp_store(url: str, namespace: str) -> StampStore:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryStampStore() if url == "memory://" else RedisStampStore(url, namespace)
