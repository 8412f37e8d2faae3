"""The gateway's link to Kafka: connected at start when the broker answers, else retried in the background.

Why: the gateway answers searches; Kafka only carries their traces, and the outbox already spools a
trace Kafka does not acknowledge. So an unreachable broker at start is not a reason to refuse
traffic: the gateway starts, every trace is spooled (fsynced before its answer) from the first
request, and this link keeps trying to connect, backing off as the bus does for a passing outage;
once it is connected the outbox is woken and drains the spool, oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from schemas.topics import TopicSpec
from services.common.bus import Bus, transient_delay

log = logging.getLogger(__name__)
LinkState = Literal["connected", "connecting", "stopped"]


class KafkaLink:
    """Starts ``bus`` on ``topics``, now or as soon as the broker answers; says how it stands."""

    def __init__(self, bus: Bus, topics: tuple[TopicSpec, ...], *, connect_timeout_s: float,
                 on_connected: Callable[[], None], required: bool = False) -> None:
        self.bus, self.topics, self.connect_timeout_s, self.on_connected = bus, topics, connect_timeout_s, on_connected
        self.required = required  # an unreachable broker at start is an error (raised), not an outage
        self.state: LinkState = "stopped"
        self.error: str | None = None
        self.down_since: float | None = None  # wall clock of the first failed attempt of this outage
        self.attempts = 0
        self.reconnects = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    async def start(self) -> None:
        """One attempt now; if the broker does not answer, keep trying in the background (the outbox
        spools meanwhile), unless ``required``: then the start fails."""
        self.state = "connecting"
        if self.required:
            await self.bus.start(self.topics)  # raises BusError, as a gateway that needs Kafka should
            self.state = "connected"
            self.on_connected()  # what an earlier run spooled drains now, not at the next spooled trace
            return
        if await self._attempt():
            return
        log.warning("Kafka at %s unreachable at start (%s): serving anyway, every trace is spooled until it "
                    "answers", self.bus.settings.bootstrap_servers, self.error)
        self._task = asyncio.create_task(self._retry(), name="gateway:kafka-connect")

    async def _attempt(self) -> bool:
        self.attempts += 1
        try:
            await asyncio.wait_for(self.bus.start(self.topics), timeout=self.connect_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # BusError, a timeout, aiokafka's own types: all "not yet"
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self.down_since = self.down_since or time.time()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.bus.stop(), timeout=self.connect_timeout_s)  # a clean slate to retry on
            return False
        if self.down_since is not None:
            log.info("Kafka at %s reachable after %.1f s and %d attempts; draining the spool",
                     self.bus.settings.bootstrap_servers, time.time() - self.down_since, self.attempts)
        self.state, self.error, self.down_since = "connected", None, None
        self.on_connected()
        return True

    async def _retry(self) -> None:
        n = 0
        while not await self._attempt():
            n += 1
            await asyncio.sleep(transient_delay(self.bus.settings, n))

    def reconnect(self, why: str) -> None:
        """The producer is stuck (an idempotent producer whose sequence the broker refuses keeps failing
        every send): drop the connection and connect afresh in the background; the outbox spools meanwhile."""
        if self.state != "connected":
            return
        log.warning("Kafka producer unusable (%s): reconnecting; traces are spooled meanwhile", why)
        self.state, self.error, self.down_since = "connecting", why, time.time()
        self.reconnects += 1

        async def again() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.bus.stop(), timeout=self.connect_timeout_s)
            await self._retry()

        self._task = asyncio.create_task(again(), name="gateway:kafka-reconnect")

    async def stop(self, timeout_s: float) -> None:
        """Stop trying; disconnect when connected, waiting at most ``timeout_s`` (a broker that went away
        can hold the producer's flush forever; what it holds is in the spool)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        was = self.state
        self.state = "stopped"
        if was == "connected":
            try:
                await asyncio.wait_for(self.bus.stop(), timeout=max(timeout_s, 0.01))
            except TimeoutError:
                aborted = self.bus.abort_producer()
                log.warning("Kafka did not let the producer stop within %.1f s; %s (unacknowledged traces are in "
                            "the spool)", timeout_s, "its sender aborted" if aborted else "stopped without it")

    def describe(self) -> dict[str, Any]:
        """For ``/healthz``."""
        out: dict[str, Any] = {"state": "memory" if self.bus.in_memory and self.connected else self.state,
                               "bootstrap_servers": self.bus.settings.bootstrap_servers}
        if not self.connected and self.down_since is not None:
            out |= {"error": self.error, "down_for_s": round(time.time() - self.down_since, 1),
                    "attempts": self.attempts}
        if self.reconnects:
            out["reconnects"] = self.reconnects
        return out
