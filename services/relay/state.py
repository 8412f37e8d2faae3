"""A trace's calls so far, shared by every relay replica: what splicing and the episode's fold read.

Redis keeps, per trace id, a counter (the next call index) and a list of entries, each the ``Call``
record plus the normalised conversation and reply that splicing compares against, all with a TTL
(``state_ttl_s``). ``memory://`` keeps it in process (unit tests). Kafka's ``calls`` topic holds the
same records for good.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Callable
from typing import Any

from schemas.call import Call
from services.relay.render import Prior


def _key(namespace: str, kind: str, trace_id: str) -> str:
    return f"fanroute:{namespace}relay:{kind}:{trace_id}"


def entry_of(call: Call, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
             reply: dict[str, Any]) -> dict[str, Any]:
    return {"call": call.model_dump(mode="json"), "messages": messages, "tools": tools, "reply": reply}


def prior_of(entry: dict[str, Any]) -> Prior:
    call = entry["call"]
    return Prior(index=call["call_index"], messages=tuple(entry["messages"]), tools=tuple(entry["tools"]),
                 reply=entry["reply"], prompt_ids=tuple(call["prompt_ids"]), sampled_ids=tuple(call["sampled_ids"]))


class CallState(abc.ABC):
    """Per-trace call indexes and entries."""

    @abc.abstractmethod
    async def next_index(self, trace_id: str) -> int: ...

    @abc.abstractmethod
    async def append(self, trace_id: str, entry: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def entries(self, trace_id: str) -> list[dict[str, Any]]: ...

    async def calls(self, trace_id: str) -> list[Call]:
        """The trace's ``Call`` records in call-index order."""
        return sorted((Call.model_validate(e["call"]) for e in await self.entries(trace_id)),
                      key=lambda c: c.call_index)

    async def close(self) -> None:
        """Release connections."""


class MemoryCallState(CallState):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self.counters: dict[str, int] = {}
        self.lists: dict[str, tuple[list[dict[str, Any]], float]] = {}

    async def next_index(self, trace_id: str) -> int:
        self.counters[trace_id] = self.counters.get(trace_id, -1) + 1
        return self.counters[trace_id]

    async def append(self, trace_id: str, entry: dict[str, Any]) -> None:
        items = self.lists.get(trace_id, ([], 0.0))[0]
        self.lists[trace_id] = ([*items, json.loads(json.dumps(entry))], self.clock() + self.ttl_s)

    async def entries(self, trace_id: str) -> list[dict[str, Any]]:
        items, until = self.lists.get(trace_id, ([], 0.0))
        return list(items) if until > self.clock() else []


class RedisCallState(CallState):
    def __init__(self, url: str, namespace: str, ttl_s: float) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.namespace, self.ttl_ms = namespace, int(ttl_s * 1000)

    async def next_index(self, trace_id: str) -> int:
        key = _key(self.namespace, "next", trace_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.pexpire(key, self.ttl_ms)
            n, _ = await pipe.execute()
        return int(n) - 1

    async def append(self, trace_id: str, entry: dict[str, Any]) -> None:
        key = _key(self.namespace, "calls", trace_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, json.dumps(entry))
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()

    async def entries(self, trace_id: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in await self.client.lrange(_key(self.namespace, "calls", trace_id), 0, -1)]

    async def close(self) -> None:
        await self.client.aclose()


def call_state(url: str, namespace: str, ttl_s: float) -> CallState:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryCallState(ttl_s) if url == "memory://" else RedisCallState(url, namespace, ttl_s)
