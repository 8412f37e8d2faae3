"""The runner's ledger of accepted task records whose group is not published yet (Redis, dict in memory mode).

Why: the runner commits a task's offset as soon as it has queued it (a group outlives Kafka's poll
interval), so the task record alone cannot bring a group back after a crash. Each accepted record is
written here first (before the commit), keyed by its place in the log (``RecordRef.key``: the same task
sent twice is two records, two groups); when its group is on ``rollouts`` the key moves to a done set
(kept ``DONE_RETENTION_S``). A starting runner queues again whatever a killed one left pending; a record
redelivered because the kill came before its commit is already pending or done, and is not run again.
"""

from __future__ import annotations

import abc
import logging
import time

from schemas.base import decode
from schemas.task import Task
from services.common.errors import SchemaError
from services.common.idempotency import redis_transient

log = logging.getLogger(__name__)

DONE_RETENTION_S = 7 * 86_400  # longer than any redelivery: a done key is needed only until its offset commits


class Ledger(abc.ABC):
    """Accepted task records by key (log order, so a restart resumes the oldest first)."""

    @abc.abstractmethod
    async def accept(self, key: str, task: Task) -> bool:
        """Record ``task`` as accepted under ``key``; False when ``key`` is already pending or done."""

    @abc.abstractmethod
    async def done(self, key: str) -> None:
        """``key``'s group is published (or never can be): no longer pending, remembered as done."""

    @abc.abstractmethod
    async def pending(self) -> list[tuple[str, Task]]:
        """Records accepted and not done, in key order."""

    async def intact(self) -> bool:
        """False once the ledger lost what it held since :meth:`arm` (Redis flushed or restarted empty)."""
        return True

    async def arm(self) -> None:
        """Mark the ledger complete (after a start or a rebuild): its loss shows in :meth:`intact`."""

    async def close(self) -> None:
        """Release connections."""


class MemoryLedger(Ledger):
    """In-process (lost on exit): the embedded default and unit tests."""

    def __init__(self) -> None:
        self.entries: dict[str, Task] = {}
        self.finished: set[str] = set()

    async def accept(self, key: str, task: Task) -> bool:
        if key in self.entries or key in self.finished:
            return False
        self.entries[key] = task
        return True

    async def done(self, key: str) -> None:
        self.entries.pop(key, None)
        self.finished.add(key)

    async def pending(self) -> list[tuple[str, Task]]:
        return sorted(self.entries.items())


class RedisLedger(Ledger):
    """A hash of pending records (key -> the task's JSON) and a sorted set of done keys (by time), per runner
    consumer group and shared by its restarts."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.pending_key, self.done_key = f"{prefix}:pending", f"{prefix}:done"
        self.intact_key = f"{prefix}:intact"

    async def intact(self) -> bool:
        with redis_transient("rollout ledger"):
            return bool(await self.client.exists(self.intact_key))

    async def arm(self) -> None:
        with redis_transient("rollout ledger"):
            await self.client.set(self.intact_key, b"1")

    async def accept(self, key: str, task: Task) -> bool:
        with redis_transient("rollout ledger"):
            if await self.client.zscore(self.done_key, key) is not None:
                return False
            return bool(await self.client.hsetnx(self.pending_key, key, task.model_dump_json()))

    async def done(self, key: str) -> None:
        now = time.time()
        with redis_transient("rollout ledger"):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zadd(self.done_key, {key: now})
                pipe.hdel(self.pending_key, key)
                pipe.zremrangebyscore(self.done_key, "-inf", now - DONE_RETENTION_S)
                await pipe.execute()

    async def pending(self) -> list[tuple[str, Task]]:
        """Pending entries; one that no longer parses is logged and skipped (left in Redis for a person), so it
        cannot stop the runner from starting."""
        with redis_transient("rollout ledger"):
            raw = await self.client.hgetall(self.pending_key)
        out = []
        for k, v in sorted(raw.items()):
            try:
                out.append((k.decode(), decode(Task, v)))
            except SchemaError as exc:
                log.error("rollout ledger %s: entry %r is not a task, skipped and left in place: %s",
                          self.pending_key, k, exc)
        return out

    async def close(self) -> None:
        await self.client.aclose()


def ledger(url: str, namespace: str, group_id: str) -> Ledger:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryLedger() if url == "memory://" else RedisLedger(url, f"{namespace}rollouts:ledger:{group_id}")
