"""The runner's ledger of accepted tasks whose group is not published yet (Redis hash, dict in memory mode).

Why: the runner commits a task's offset as soon as it has queued it (a group outlives Kafka's poll
interval), so the task record alone cannot bring a group back after a crash. Each accepted task is written
here first (before the commit), removed when its group is on ``rollouts``, and a starting runner queues
again whatever a killed one left. A runner killed between publishing a group and removing its entry runs
that task twice (two groups); the trainer takes the first for its send and counts the other foreign.
"""

from __future__ import annotations

import abc

from schemas.base import decode
from schemas.task import Task
from services.common.idempotency import redis_transient


class Ledger(abc.ABC):
    """Accepted tasks by entry id (time-ordered, so a restart resumes the oldest first)."""

    @abc.abstractmethod
    async def add(self, entry: str, task: Task) -> None:
        """Record ``task`` as accepted under ``entry``."""

    @abc.abstractmethod
    async def done(self, entry: str) -> None:
        """``entry``'s group is published (or can never be): forget it."""

    @abc.abstractmethod
    async def pending(self) -> list[tuple[str, Task]]:
        """Entries a previous run accepted and did not finish, oldest entry id first."""

    async def close(self) -> None:
        """Release connections."""


class MemoryLedger(Ledger):
    """In-process (lost on exit): the embedded default and unit tests."""

    def __init__(self) -> None:
        self.entries: dict[str, Task] = {}

    async def add(self, entry: str, task: Task) -> None:
        self.entries[entry] = task

    async def done(self, entry: str) -> None:
        self.entries.pop(entry, None)

    async def pending(self) -> list[tuple[str, Task]]:
        return sorted(self.entries.items())


class RedisLedger(Ledger):
    """One hash per runner consumer group, shared by its restarts (entry id -> the task's JSON)."""

    def __init__(self, url: str, key: str) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.key = key

    async def add(self, entry: str, task: Task) -> None:
        with redis_transient("rollout ledger"):
            await self.client.hset(self.key, entry, task.model_dump_json())

    async def done(self, entry: str) -> None:
        with redis_transient("rollout ledger"):
            await self.client.hdel(self.key, entry)

    async def pending(self) -> list[tuple[str, Task]]:
        with redis_transient("rollout ledger"):
            raw = await self.client.hgetall(self.key)
        return sorted((k.decode(), decode(Task, v)) for k, v in raw.items())

    async def close(self) -> None:
        await self.client.aclose()


def ledger(url: str, namespace: str, group_id: str) -> Ledger:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryLedger() if url == "memory://" else RedisLedger(url, f"{namespace}rollouts:pending:{group_id}")
