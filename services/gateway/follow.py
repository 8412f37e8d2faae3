"""Which router version is promoted, followed without a restart: the ``adapters`` topic as it happens,
the Redis promoted key polled as a backstop.

The latest promotion wins, not the highest version: a rollback is a promotion of an older version.
At start the Redis key is authoritative; only when it is empty is the topic read from the beginning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.adapter import AdapterPublished, versioned_name
from schemas.topics import topic
from services.common.bus import Bus
from services.common.replay_topic import read_topic
from services.common.stamps import StampStore

log = logging.getLogger(__name__)
#: How long start waits for the tail to know its offset (a group join; a new topic's leader election).
TAIL_READY_S = 15.0


@dataclass(frozen=True)
class Promoted:
    """The promoted version, its served name (``router@3``) and the fallback measured beside it."""

    version: int
    router: str
    fallback_provider: str | None


class PromotedFollower:
    """Keeps :attr:`current` at the latest promotion of ``model_id``; every replica sees every promotion."""

    def __init__(self, model_id: str, bus: Bus, *, stamps: StampStore | None, poll_s: float, group_id: str,
                 on_change: Callable[[Promoted], None] | None = None) -> None:
        self.model_id = model_id
        self.bus = bus
        self.stamps = stamps
        self.poll_s = poll_s
        self.group_id = group_id
        self.on_change = on_change
        self._current: Promoted | None = None
        self._redis_seen: tuple[int, str | None] | None = None
        self._changed = asyncio.Condition()
        self._poller: asyncio.Task[None] | None = None
        self._tail: Any = None

    @property
    def current(self) -> Promoted | None:
        """The version to route with, or None while nothing is promoted."""
        return self._current

    def subscribe(self) -> None:
        """Tail the adapters topic (call before the bus starts). A group per replica, from the end:
        what was promoted before start comes from Redis or the topic replay in :meth:`start`."""
        self._tail = self.bus.subscribe(topic("adapters"), self.on_message, group_id=self.group_id,
                                        auto_offset_reset="latest")

    async def start(self) -> None:
        """Load the current promotion (Redis, else the topic from the beginning), then poll Redis.

        The tail is positioned first, then the topic replayed: a promotion lands either before the
        replay's end or at or after the tail's offset, so none published during start is missed."""
        found = await self._read_redis()
        self._redis_seen = found
        if self._tail is not None and not await self.bus.positioned(self._tail, TAIL_READY_S):
            log.warning("the adapters topic's tail has no offset yet: a promotion published meanwhile is "
                        "picked up by the Redis poll, not the topic")
        if found is None:
            found = await self._replay_topic()
        if found is not None and self._current is None:  # a tailed promotion during start is newer
            await self._set(*found, source="start")
        if self._current is None:
            log.warning("no promoted version of %s yet: routed requests use the fallback provider", self.model_id)
        if self.stamps is not None:
            self._poller = asyncio.create_task(self._poll(), name=f"poll-promoted:{self.model_id}")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        if self.stamps is not None:
            await self.stamps.close()

    async def on_message(self, msg: AdapterPublished) -> None:
        """One ``adapters`` message: a promotion of our model id becomes current."""
        if msg.model_id == self.model_id and msg.promoted:
            await self._set(msg.version, msg.fallback_provider, source="topic")

    async def wait_for(self, predicate: Callable[[Promoted | None], bool], timeout_s: float) -> Promoted | None:
        """Wait until ``predicate(current)`` holds (TimeoutError after ``timeout_s``); returns current."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self._current))
        return self._current

    async def poll_once(self) -> None:
        """Apply the Redis key if it changed since last read (an unchanged key never undoes a newer
        promotion the topic delivered first)."""
        found = await self._read_redis()
        if found is not None and found != self._redis_seen:
            await self._set(*found, source="redis")
        if found is not None:
            self._redis_seen = found

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll_once()

    async def _read_redis(self) -> tuple[int, str | None] | None:
        if self.stamps is None:
            return None
        try:
            return await self.stamps.promoted(self.model_id)
        except Exception as exc:  # Redis down or a bad value: keep what we follow, the topic still works
            log.warning("cannot read the promoted version of %s from Redis: %s: %s", self.model_id,
                        type(exc).__name__, exc)
            return None

    async def _replay_topic(self) -> tuple[int, str | None] | None:
        """The last promotion of our model id on the adapters topic (one partition: topic order)."""
        if self.bus.in_memory:
            return None
        found = None
        try:
            async for msg in read_topic(self.bus.settings, topic("adapters"), model=AdapterPublished):
                if msg.model_id == self.model_id and msg.promoted:
                    found = (msg.version, msg.fallback_provider)
        except Exception as exc:  # start must not fail on it; the tail and the poll catch up
            log.warning("cannot replay the adapters topic: %s: %s", type(exc).__name__, exc)
        return found

    async def _set(self, version: int, fallback_provider: str | None, *, source: str) -> None:
        new = Promoted(version, versioned_name(self.model_id, version), fallback_provider)
        if new != self._current:
            log.info("routing with %s (fallback provider %s; from %s)", new.router, fallback_provider, source)
        self._current = new
        if self.on_change is not None:
            self.on_change(new)
        async with self._changed:
            self._changed.notify_all()
