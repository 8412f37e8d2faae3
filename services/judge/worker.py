"""The judge worker: ``traces`` → (sample, blind, judge) → ``verdicts``.

Idempotent and additive: the verdict id is derived from (trace id, judge, rubric hash), a replayed
trace is recognised by that id and not judged again, and a new rubric or judge is a new id, so
its verdict lands beside the old one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from schemas.base import content_id
from schemas.topics import topic
from schemas.trace import Trace
from schemas.verdict import CandidateGrade, Verdict
from services.common.bus import Bus
from services.common.idempotency import KeyStore
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.judge.base import JudgeBackend, JudgeFailed, JudgeResult
from services.judge.blind import Blinded, blind
from services.judge.rubric import RUBRIC_VERSION
from services.judge.sampling import Reason, sample_reason

if TYPE_CHECKING:
    from services.judge.settings import JudgeSettings

log = logging.getLogger(__name__)


def verdict_id(trace_id: str, backend: JudgeBackend, rubric: str) -> str:
    """Derived from (trace, judge identity, rubric hash): a replay maps to the same verdict."""
    ident = backend.identity
    return content_id("verdict", trace_id, ident.kind, ident.model, rubric)


def judge_key(backend: JudgeBackend, rubric: str) -> str:
    """A short stable name for (judge, rubric): consumer group and key-store prefix."""
    ident = backend.identity
    return f"{ident.kind}-{content_id(ident.kind, ident.model, ident.endpoint, rubric, length=12)}"


class JudgeMetrics:
    """What the worker counts: judged (ok/failed), unsampled, replays skipped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.verdicts = Counter("fanroute_judge_verdicts", "Verdicts published", ["status", "reason"],
                                registry=self.registry)
        self.unsampled = Counter("fanroute_judge_unsampled", "Traces not sampled for judging",
                                 registry=self.registry)
        self.replays = Counter("fanroute_judge_replays_skipped", "Traces already judged (replay/restart)",
                               registry=self.registry)


class JudgeWorker:
    """Turns one trace into at most one verdict per (judge, rubric)."""

    def __init__(self, bus: Bus, backend: JudgeBackend, store: KeyStore, *, sample_rate: float,
                 hide: tuple[str, ...] = ()) -> None:
        self.bus, self.backend, self.store = bus, backend, store
        self.sample_rate = sample_rate
        self.hide = hide
        self.rubric = backend.rubric
        self.key = judge_key(backend, self.rubric)
        self.metrics = JudgeMetrics()

    async def reconcile(self, kafka: KafkaSettings) -> int:
        """Mark every verdict already on the topic as done; returns how many were found.

        Closes the gap between "published" and "marked" if a worker died in it, so a restart
        never publishes the same verdict twice.
        """
        if self.bus.in_memory:
            return 0
        n = 0
        async for verdict in read_topic(kafka, topic("verdicts")):
            await self.store.mark(verdict.verdict_id)
            n += 1
        return n

    async def handle(self, trace: Trace) -> None:
        """Sample, skip replays, judge blind, publish the verdict, then remember it."""
        reason = sample_reason(trace, self.sample_rate)
        if reason is None:
            self.metrics.unsampled.inc()
            await self.store.add("unsampled", trace.trace_id)
            return
        vid = verdict_id(trace.trace_id, self.backend, self.rubric)
        if await self.store.seen(vid):
            self.metrics.replays.inc()
            return
        verdict = await self.judge(trace, reason, vid)
        await self.bus.publish(topic("verdicts"), verdict)
        await self.store.mark(vid)
        self.metrics.verdicts.labels(verdict.status, reason).inc()

    async def judge(self, trace: Trace, reason: Reason, vid: str) -> Verdict:
        """The verdict for ``trace``: status ``failed`` with the reason if the judge could not."""
        seen = blind(trace, 0, hide=self.hide)
        ident = self.backend.identity
        common = dict(verdict_id=vid, trace_id=trace.trace_id, judged_at=datetime.now(UTC),
                      judge_kind=ident.kind, judge_model=ident.model, judge_endpoint=ident.endpoint,
                      rubric_version=RUBRIC_VERSION, rubric_hash=self.rubric, sampled_because=reason,
                      letters=seen.letters, shuffle_seed=seen.seed)
        try:
            result = await self.backend.judge(seen.request) if seen.letters else JudgeResult({}, ())
        except JudgeFailed as exc:
            log.warning("judge failed on trace %s: %s", trace.trace_id, exc)
            return Verdict(status="failed", failure_reason=str(exc)[:2000], **common)
        grades, ordering = to_providers(seen, result)
        return Verdict(status="ok", grades=grades, ordering=ordering, **common)


def to_providers(seen: Blinded, result: JudgeResult) -> tuple[tuple[CandidateGrade, ...],
                                                                 tuple[tuple[str, ...], ...]]:
    """Map letters back to provider names; failed providers get 0 by rule, in the last tier.

    They join the judge's last tier when everything there is graded 0 too (no manufactured order
    between two grade-0 candidates), else they form a tier of their own.
    """
    grades = [CandidateGrade(provider=seen.letters[L], letter=L, grade=g) for L, g in result.grades.items()]
    grades += [CandidateGrade(provider=p, grade=0, judged=False) for p in seen.not_shown]
    tiers = [tuple(sorted(seen.letters[L] for L in tier)) for tier in result.ordering]
    failed = tuple(sorted(seen.not_shown))
    if failed:
        last_all_zero = bool(tiers) and all(result.grades[L] == 0 for L in result.ordering[-1])
        if last_all_zero:
            tiers[-1] = tuple(sorted(tiers[-1] + failed))
        else:
            tiers.append(failed)
    return tuple(sorted(grades, key=lambda g: g.provider)), tuple(tiers)


async def run(settings: JudgeSettings, stop: asyncio.Event | None = None) -> None:
    """Consume traces until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from services.common.bus import ensure_topics
    from services.common.idempotency import key_store
    from services.judge.guard import provider_hosts
    from services.judge.settings import build_backend

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backend = build_backend(settings.judge)
    await backend.start()
    bus = Bus(settings.kafka, client_id="fanroute-judge")
    key = judge_key(backend, backend.rubric)
    prefix = f"fanroute:{settings.kafka.topic_namespace}judge:{key}"  # namespaced like the topics
    worker = JudgeWorker(bus, backend, key_store(settings.redis.url, prefix),
                         sample_rate=settings.sample_rate, hide=provider_hosts(settings))
    bus.subscribe(topic("traces"), worker.handle, group_id=f"{settings.group_prefix}.{worker.key}")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=worker.metrics.registry)
    if settings.kafka.ensure_topics:
        await ensure_topics(settings.kafka, [(bus.name(s), s) for s in (topic("traces"), topic("verdicts"))])
    found = await worker.reconcile(settings.kafka)  # before consuming: see JudgeWorker.reconcile
    worker.store.rebuild = lambda: worker.reconcile(settings.kafka)  # marks gone (FLUSHALL): rebuilt first
    await worker.store.arm()
    await bus.start()
    log.info("reconciled %d verdicts already on the topic", found)
    log.info("judge %s (%s) consuming traces as group %s.%s", backend.identity.model,
             backend.identity.kind, settings.group_prefix, worker.key)
    try:
        await stop.wait()
    finally:
        await bus.stop()
        await worker.store.close()
        await backend.close()
