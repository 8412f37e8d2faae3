"""The console's reader: each topic it shows, followed into the store from the offsets the store holds.

One task per topic. A batch and its offsets are stored in one transaction, so a restart resumes exactly
where the store stopped. A broker that is not there yet (or goes away) is retried with backoff; the pages
keep serving what is stored meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from schemas.topics import topic, wire_name
from services.common.replay_topic import follow_topic_records
from services.common.settings import KafkaSettings
from services.console.store import ConsoleStore

log = logging.getLogger(__name__)
#: The topics the console shows.
FOLLOWED = ("traces", "verdicts", "reviews", "adapters", "cycles")


@dataclass
class FollowState:
    """What the status line says about one followed topic."""

    stored: int = 0
    unreadable: int = 0
    error: str | None = None
    caught_up: bool = False


@dataclass
class Follower:
    """Follows :data:`FOLLOWED` into ``store`` until stopped."""

    kafka: KafkaSettings
    store: ConsoleStore
    poll_ms: int = 1000
    state: dict[str, FollowState] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> None:
        # one literal per topic: the registry's test reads which topics each service consumes from these
        self._spawn(topic_name="traces")
        self._spawn(topic_name="verdicts")
        self._spawn(topic_name="reviews")
        self._spawn(topic_name="adapters")
        self._spawn(topic_name="cycles")

    def _spawn(self, *, topic_name: str) -> None:
        self.state[topic_name] = FollowState()
        self._tasks.append(asyncio.create_task(self._follow(topic_name), name=f"console-follow-{topic_name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _follow(self, topic_name: str) -> None:
        spec = topic(topic_name)
        state, backoff = self.state[topic_name], 0.5
        wire = wire_name(self.kafka, spec)

        def unreadable(_rec: object, _exc: Exception) -> None:
            state.unreadable += 1

        while True:
            try:
                async for batch in follow_topic_records(self.kafka, spec, start=self.store.offsets(wire),
                                                        poll_ms=self.poll_ms, on_unreadable=unreadable):
                    state.error, backoff = None, 0.5
                    if batch:
                        state.stored += await asyncio.to_thread(self.store.ingest, wire, batch)
                    state.caught_up = not batch
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker went away or is not there yet: retried, never fatal
                state.error = f"{type(exc).__name__}: {exc}"
                log.warning("console: following %s failed (%s); retrying in %.1fs", wire, state.error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
