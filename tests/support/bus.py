"""The in-memory bus with a collector on one topic, for unit tests of workers that publish."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from schemas.topics import TopicSpec
from services.common.bus import Bus
from services.common.settings import KafkaSettings


@asynccontextmanager
async def collecting(spec: TopicSpec, group_id: str = "test") -> AsyncIterator[tuple[Bus, list[Any]]]:
    """A started ``memory://`` bus and the list that every message published on ``spec`` lands in."""
    bus = Bus(KafkaSettings(bootstrap_servers="memory://"))
    got: list[Any] = []

    async def collect(message: Any) -> None:
        got.append(message)

    bus.subscribe(spec, collect, group_id=group_id)
    await bus.start()
    try:
        yield bus, got
    finally:
        await bus.stop()
