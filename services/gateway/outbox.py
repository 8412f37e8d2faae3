"""The gateway's trace outbox: publish, and spool what Kafka does not acknowledge in time.

``publish`` sends the trace and waits at most ``publish_wait_s`` for acks=all. Acknowledged: the answer
says ``published``. Not (the broker is slow, paused or down): the record, exactly as it was sent (wire
topic, key = trace id, headers, value), is appended to the local spool and fsynced *before* the answer
goes out with ``spooled``. The first send is not cancelled: the idempotent producer keeps retrying it,
and if it lands later the spooled copy is marked done without a second publish. A background task
re-publishes, oldest first, whatever is still pending (the first send failed, or this is a restart that
found records left in the spool), backing off while Kafka is away. A re-publish keeps the trace id as key,
and before it sends a record that was handed to Kafka before (its send failed, or an earlier run spooled
it) it reads the topic since that record's first send for its key (:class:`KeyWatch`): a send that failed
on the client after the broker wrote it (a lost answer, a producer the broker stopped trusting mid-batch)
is acked, not written twice. A record written after that read (a request the broker still held) can
still land twice; consumers deduplicate by trace id, so it is one trace to each of them.

A spool that is full or cannot be written is an error the caller sees (:class:`SpoolError`, answered
503 by the app) and a metric counts; a trace is never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

from schemas.topics import topic
from schemas.trace import Trace
from services.common import paths
from services.common.bus import Bus, transient_delay
from services.common.replay_topic import KeyWatch
from services.common.spool import Spool, SpoolError, SpoolRecord, SpoolUnavailable
from services.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)
TraceStatus = Literal["published", "spooled"]
DRAIN_BATCH = 64  # records re-published concurrently (sent in spool order)
SEND_MARGIN_S = 60.0  # a record's first send began at most publish_wait_s (and this, for clocks) before its spooling
WATCH_TIMEOUT_S = 30.0  # one read of the topic for keys already there (progress is kept past it)
WATCH_MAX_KEYS = 500_000  # a watch that remembers more starts again from the spool's oldest record


def default_spool_dir(cache_dir: Path | None) -> Path:
    """``<cache_dir>/spool`` (``cache_dir`` defaults to :func:`services.common.paths.cache_root`)."""
    return paths.spool_dir(cache_dir)


class TraceOutbox:
    """Publish with a bounded wait; spool, then drain, what was not acknowledged."""

    def __init__(self, bus: Bus, metrics: GatewayMetrics, *, spool_dir: Path, publish_wait_s: float,
                 max_bytes: int, max_records: int, check_topic: bool = True) -> None:
        self.bus, self.metrics, self.publish_wait_s = bus, metrics, publish_wait_s
        self.spool = Spool(spool_dir, "traces", max_bytes=max_bytes, max_records=max_records)
        self._inflight: dict[int, asyncio.Future[None]] = {}  # spooled seq -> its first send, still going
        self._landed: set[int] = set()  # spooled seqs whose first send was acknowledged later
        self._loose: set[asyncio.Future[None]] = set()  # first sends of traces refused a spool slot
        self._spooling: set[bytes | None] = set()  # keys being appended: on disk, their first send not yet known
        self._never_sent: set[int] = set()  # spooled with no link to Kafka: no send can have written them
        self._watch: KeyWatch | None = None  # what the topic holds since the oldest sent record, for one drain
        #: makes the watch of a topic since a time (ms); None: re-publish without looking (the in-memory bus)
        self.watch_factory: Callable[[str, int], KeyWatch] | None = (
            (lambda name, since_ms: KeyWatch(bus.settings, name, since_ms)) if check_topic and not bus.in_memory
            else None)
        self._wake = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None
        self._stopping = False
        self.kafka_ready: Callable[[], bool] = lambda: True  # False while the gateway has no link to Kafka
        self.on_stuck_producer: Callable[[str], None] = lambda why: None  # the gateway reconnects
        self.adopt_from: list[Path] = []  # spools of workers that no longer run, adopted at start
        m = metrics
        if not m.multiprocess:  # read when scraped; a worker of several writes them out (export_gauges)
            m.spool_depth.set_function(lambda: self.spool.depth)
            m.spool_oldest_age.set_function(self.spool.oldest_age_s)
            m.spool_available.set_function(lambda: 1.0 if self.spool.available else 0.0)

    def export_gauges(self) -> None:
        """Write the spool's gauges (a worker's values, collected across workers by ``/metrics``)."""
        m = self.metrics
        m.spool_depth.set(self.spool.depth)
        m.spool_oldest_age.set(self.spool.oldest_age_s())
        m.spool_available.set(1.0 if self.spool.available else 0.0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the spool (what an earlier run left is drained) and start the drainer."""
        try:
            await asyncio.to_thread(self.spool.open)
        except SpoolUnavailable as exc:
            log.error("trace spool unavailable: %s; a trace Kafka does not acknowledge within %.2f s will be "
                      "answered 503", exc, self.publish_wait_s)
        if self.adopt_from and self.spool.available:
            from services.gateway.workers import adopt

            await asyncio.to_thread(adopt, self.adopt_from, self.spool)
        if self.spool.depth:
            log.warning("trace spool %s holds %d traces from an earlier run (oldest %.0f s); re-publishing",
                        self.spool.path, self.spool.depth, self.spool.oldest_age_s())
        if self.spool.torn_tail or self.spool.corrupt:
            self.metrics.spool_damaged.inc(int(self.spool.torn_tail) + self.spool.corrupt)
        self._drainer = asyncio.create_task(self._drain(), name="trace-spool-drainer")

    async def stop(self) -> None:
        """Stop draining; give the first sends still going ``publish_wait_s`` to land, record what did."""
        self._stopping = True
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
            self._drainer = None
        going = [f for f in self._inflight.values() if not f.done()] + list(self._loose)
        if going:
            await asyncio.wait(going, timeout=self.publish_wait_s)
        for seq, fut in list(self._inflight.items()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._landed.add(seq)
        await asyncio.to_thread(self._apply_landed)
        if self.spool.depth:
            log.warning("gateway stopping with %d traces in the spool %s; the next start re-publishes them",
                        self.spool.depth, self.spool.path)
        await asyncio.to_thread(self.spool.close)

    # ------------------------------------------------------------------ the request path
    async def publish(self, trace: Trace) -> tuple[TraceStatus, str | None]:
        """``("published", None)``, or ``("spooled", why)``; raises :class:`SpoolError` when neither."""
        wire, value, key, headers = self.bus.record_of(topic("traces"), trace)
        self.metrics.trace_bytes.observe(len(value))
        sent = self.kafka_ready()
        if not sent:  # no link yet (the gateway started in an outage): straight to the spool
            send: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            send.set_exception(ConnectionError("Kafka unreachable since the gateway started"))
        else:
            send = asyncio.ensure_future(self.bus.publish_raw(wire, value, key=key, headers=headers, timeout_s=None))
        done, _ = await asyncio.wait({send}, timeout=self.publish_wait_s)
        if send in done and send.exception() is None:
            self.metrics.traces_published.inc()
            return "published", None
        why = (str(send.exception()) if send in done else
               f"Kafka did not acknowledge within publish_wait_s={self.publish_wait_s:g}s")
        self._spooling.add(key)  # until its first send is registered the drainer must not take it
        try:
            return await self._spool(send, wire, value, key, headers, trace.trace_id, why, sent=sent)
        finally:
            self._spooling.discard(key)

    async def _spool(self, send: asyncio.Future[None], wire: str, value: bytes, key: bytes | None,
                     headers: dict[str, str], trace_id: str, why: str, *, sent: bool) -> tuple[TraceStatus, str]:
        try:
            rec = await asyncio.to_thread(self.spool.append, wire, value, key=key, headers=headers)
        except SpoolError as exc:
            self.metrics.traces_unpublished.inc()
            self.metrics.spool_refused.labels(exc.kind).inc()
            log.error("trace %s neither acknowledged (%s) nor spooled: %s", trace_id, why, exc)
            if not send.done():  # it may still land; keep a reference so the send is not collected
                self._loose.add(send)
                send.add_done_callback(self._loose.discard)
            else:
                send.exception()  # retrieved: no "never retrieved" warning
            raise
        self.metrics.traces_spooled.inc()
        if not sent:
            self._never_sent.add(rec.seq)
        log.warning("trace %s spooled (seq %d): %s", trace_id, rec.seq, why)
        if send.done():  # resolved while the record was written: account for it now, not on a later callback
            self._first_send_done(rec.seq, send)
        else:
            self._inflight[rec.seq] = send
            send.add_done_callback(lambda fut, seq=rec.seq: self._first_send_done(seq, fut))
        self._wake.set()
        return "spooled", why

    def _first_send_done(self, seq: int, fut: asyncio.Future[None]) -> None:
        self._inflight.pop(seq, None)
        if not fut.cancelled() and fut.exception() is None:
            self._landed.add(seq)
            self.metrics.spool_late_acks.inc()
        self._wake.set()

    # ------------------------------------------------------------------ draining
    def _apply_landed(self) -> None:
        if self._landed:
            seqs, self._landed = self._landed, set()
            self.spool.ack(seqs)

    async def _drain(self) -> None:
        retry = 0
        while not self._stopping:
            self._wake.clear()
            await asyncio.to_thread(self._apply_landed)
            batch = self.drainable()[:DRAIN_BATCH]
            if not batch or not self.kafka_ready():  # nothing, only first sends still going (they wake us
                # when they resolve), or no link to Kafka yet (it wakes us when it has one)
                if not self.spool.depth:
                    self._watch = None
                await self._woken(None)
                continue
            ok = await self._republish(batch)
            if ok:
                retry = 0
                continue
            retry += 1
            await self._woken(transient_delay(self.bus.settings, retry))

    def drainable(self) -> list[SpoolRecord]:
        """Spooled records only a re-publish can deliver, oldest first.

        Not those whose first send is still going or landed, nor one the request path is still appending:
        its record is in the spool before its first send is registered, and taking it then would publish
        it twice (once by the re-publish, once by the late ack of the first send)."""
        return [r for r in self.spool.pending() if r.seq not in self._inflight and r.seq not in self._landed
                and r.key not in self._spooling]

    async def _woken(self, timeout_s: float | None) -> None:
        """Until something is spooled or lands (or ``timeout_s``). Not ``wait_for``: on Python 3.11 it can
        swallow the drainer's cancellation when the wake-up comes at the same moment."""
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=timeout_s)
        finally:
            waiter.cancel()

    async def _republish(self, batch: list[SpoolRecord]) -> bool:
        """Send ``batch`` in spool order and wait for the outcomes; ack what landed. All landed?"""
        try:
            batch = await self._not_on_topic(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("could not read %s for traces already written (%s: %s); retrying before re-publishing",
                        batch[0].topic, type(exc).__name__, exc)
            return False
        if not batch:
            return True
        t0 = time.monotonic()
        sends = [asyncio.ensure_future(self.bus.publish_raw(r.topic, r.value, key=r.key, headers=r.headers,
                                                            timeout_s=None)) for r in batch]
        results = await asyncio.gather(*sends, return_exceptions=True)
        landed = [r.seq for r, res in zip(batch, results, strict=True) if res is None]
        failed = [res for res in results if res is not None]
        self._never_sent.difference_update(r.seq for r in batch)  # each was handed to Kafka now
        if landed:
            # counted before the ack lowers the spool's depth, so a reader that sees the depth fall sees the count
            self.metrics.spool_republished.inc(len(landed))
            await asyncio.to_thread(self.spool.ack, landed)
            log.info("re-published %d spooled traces in %.2f s; %d left", len(landed), time.monotonic() - t0,
                     self.spool.depth)
        if failed:
            exc = failed[0]
            if not isinstance(exc, Exception):
                raise exc  # CancelledError and friends
            log.warning("re-publishing spooled traces: %d of %d failed (%s); retrying", len(failed), len(batch),
                        exc)
            if _producer_stuck(exc):  # retrying on this producer fails for ever: a fresh one is needed
                self.on_stuck_producer(f"{type(exc.__cause__ or exc).__name__}: {exc}")
            return False
        return True

    async def _not_on_topic(self, batch: list[SpoolRecord]) -> list[SpoolRecord]:
        """``batch`` less the records a send already wrote (acked here, counted), found by their keys."""
        sent = [r for r in batch if r.seq not in self._never_sent]
        if not sent or self.watch_factory is None:
            return batch
        name = sent[0].topic  # the outbox spools one topic's records
        since_ms = int((min(r.ts for r in sent) - self.publish_wait_s - SEND_MARGIN_S) * 1000)
        watch = self._watch
        if watch is None or watch.name != name or watch.since_ms > since_ms or len(watch.keys) > WATCH_MAX_KEYS:
            watch = self._watch = self.watch_factory(name, since_ms)
        async with asyncio.timeout(WATCH_TIMEOUT_S):  # not wait_for: see _woken
            keys = await watch.refresh()
        there = [r.seq for r in sent if r.key in keys]
        if not there:
            return batch
        self.metrics.spool_found_on_topic.inc(len(there))
        await asyncio.to_thread(self.spool.ack, there)
        self._never_sent.difference_update(there)
        log.info("%d spooled traces were already on %s (a failed send the broker had written): not re-published",
                 len(there), name)
        done = set(there)
        return [r for r in batch if r.seq not in done]

    def wake(self) -> None:
        """Kafka is (back) there: drain now rather than at the end of the back-off."""
        self._wake.set()

    def can_take_more(self) -> bool:
        """Whether one more trace would fit in the spool (writable, under both limits, the disk not full)."""
        s = self.spool
        return s.available and s.full is None and s.depth < s.max_records and s.pending_bytes < s.max_bytes

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict[str, Any]:
        """For ``/healthz``: where the spool is, how many traces wait and for how long."""
        out: dict[str, Any] = {"status": "ok" if self.spool.available else "unavailable",
                               "path": str(self.spool.path), "depth": self.spool.depth,
                               "bytes": self.spool.pending_bytes,
                               "oldest_age_s": round(self.spool.oldest_age_s(), 3),
                               "publish_wait_s": self.publish_wait_s}
        if self.spool.error and not self.spool.available:
            out["error"] = self.spool.error
        elif self.spool.full:
            out["error"] = self.spool.full
        return out


#: aiokafka errors after which an idempotent producer refuses every further send until it is recreated
STUCK_PRODUCER = ("OutOfOrderSequenceNumber", "InvalidProducerEpoch", "ProducerFenced", "UnknownProducerId")


def _producer_stuck(exc: BaseException) -> bool:
    chain = [exc, exc.__cause__, exc.__context__]
    return any(e is not None and type(e).__name__ in STUCK_PRODUCER for e in chain) or \
        any(name in str(exc) for name in STUCK_PRODUCER)


__all__ = ["TraceOutbox", "TraceStatus", "default_spool_dir"]
