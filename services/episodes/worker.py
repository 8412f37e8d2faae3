"""The episode builder: ``traces`` + ``verdicts`` (joined by trace id, in either order) →
``episodes`` and ``tasks``.

Idempotent: each (episode, verdict) pair is produced once — a Redis key marks it after publishing,
and at start the builder re-reads the ``episodes`` topic and marks every pair already there. Tasks
are at least once: a crash between a task and its episode repeats the task record, with the same
content-derived ``task_id``. Routed traces never become episodes: only the provider the router
picked answered, so a verdict on them is a biased label (they are counted and acknowledged). A
second verdict for a trace (new judge or rubric) re-publishes the episode with its reward
component added beside the others; the first verdict's ordering stays the assistant turn.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from schemas.base import content_id
from schemas.topics import topic
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.bus import Bus
from services.common.idempotency import KeyStore, redis_transient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.episodes.build import build_episode, episode_id, ndcg_component
from services.episodes.state import JoinStore
from services.episodes.tasks import build_task

if TYPE_CHECKING:
    from services.episodes.settings import EpisodeSettings

log = logging.getLogger(__name__)


def emitted_key(ep_id: str, verdict_id: str) -> str:
    return content_id("emitted", ep_id, verdict_id)


class BuilderMetrics:
    """Episodes and tasks produced, verdicts waiting or skipped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.episodes = Counter("fanroute_episodes_published", "Episode records published", registry=self.registry)
        self.tasks = Counter("fanroute_tasks_published", "Replay tasks published", registry=self.registry)
        self.waiting = Counter("fanroute_episodes_verdicts_waiting", "Verdicts that arrived before their trace",
                               registry=self.registry)
        self.skipped = Counter("fanroute_episodes_verdicts_skipped", "Failed verdicts (no ordering)",
                               registry=self.registry)
        self.no_task = Counter("fanroute_tasks_not_built", "Judged traces no replay could score",
                               registry=self.registry)
        self.routed = Counter("fanroute_episodes_routed_skipped",
                              "Routed traces and their verdicts not turned into episodes (biased labels)",
                              ["record"], registry=self.registry)
        self.rebuilds = Counter("fanroute_episodes_state_rebuilds",
                                "Times the join state was found gone from Redis and rebuilt from the topics",
                                registry=self.registry)


class EpisodeBuilder:
    """Joins traces and verdicts and publishes episodes and replay tasks."""

    def __init__(self, bus: Bus, state: JoinStore, done: KeyStore) -> None:
        self.bus, self.state, self.done = bus, state, done
        self.metrics = BuilderMetrics()
        # One join at a time in this process: a trace and its verdict handled concurrently could
        # each miss the other. (Run one replica; see docs/episodes.md.)
        self._lock = asyncio.Lock()
        #: puts the join state back from the topics when :meth:`JoinStore.intact` says it is gone
        self.rebuild_state: Callable[[], Awaitable[object]] | None = None

    async def check_state(self) -> None:
        """Rebuild the join state first if Redis lost it (a flush, a restart without persistence)."""
        if self.rebuild_state is not None and not await self.state.intact():
            await self.rebuild_state()
            await self.state.arm()
            self.metrics.rebuilds.inc()

    async def on_trace(self, trace: Trace) -> None:
        # Redis down is transient: the bus retries the record in place (the join steps are idempotent).
        with redis_transient("episode builder state"):
            await self._on_trace(trace)

    async def on_verdict(self, verdict: Verdict) -> None:
        with redis_transient("episode builder state"):
            await self._on_verdict(verdict)

    async def _on_trace(self, trace: Trace) -> None:
        async with self._lock:
            await self.check_state()
            # Kept even when routed (it expires like any unjudged trace): a later verdict must find
            # it to be recognised as a routed trace's, instead of waiting for it forever.
            await self.state.put_trace(trace)
            waiting = await self.state.pending(trace.trace_id)
            if trace.mode == "routed":
                for record in ("trace", *("verdict" for _ in waiting)):
                    self._skip_routed(trace, record)
            else:
                for verdict in waiting:
                    await self._emit(trace, verdict)
            await self.state.drop_pending(trace.trace_id, [v.verdict_id for v in waiting])

    async def _on_verdict(self, verdict: Verdict) -> None:
        if verdict.status != "ok" or not verdict.ordering:
            self.metrics.skipped.inc()
            return
        async with self._lock:
            await self.check_state()
            trace = await self.state.get_trace(verdict.trace_id)
            if trace is None:
                self.metrics.waiting.inc()
                await self.state.add_pending(verdict)
                return
            if trace.mode == "routed":
                self._skip_routed(trace, "verdict")
                return
            await self._emit(trace, verdict)

    def _skip_routed(self, trace: Trace, record: str) -> None:
        self.metrics.routed.labels(record).inc()
        log.debug("%s of routed trace %s: no episode (only %s answered)", record, trace.trace_id,
                  ", ".join(c.provider for c in trace.candidates))

    async def _emit(self, trace: Trace, verdict: Verdict) -> None:
        ep_id = episode_id(trace.trace_id)
        key = emitted_key(ep_id, verdict.verdict_id)
        if await self.done.seen(key):
            return
        primary = await self.state.set_primary(ep_id, verdict)
        comps = await self.state.add_component(ep_id, ndcg_component(ep_id, verdict, primary.ordering))
        episode = build_episode(trace, primary, comps)
        try:
            task = build_task(trace, verdict)
        except ValueError as exc:  # e.g. every grade 0: nothing a replay could score
            log.info("no replay task for trace %s: %s", trace.trace_id, exc)
            self.metrics.no_task.inc()
            task = None
        # The task first: reconcile() trusts the episodes topic, so a crash between the two
        # publishes re-emits both (the task again with the same content-derived id) rather than
        # losing the task.
        if task is not None:
            await self.bus.publish(topic("tasks"), task)
            self.metrics.tasks.inc()
        await self.bus.publish(topic("episodes"), episode)
        self.metrics.episodes.inc()
        await self.done.mark(key)

    async def reconcile(self, kafka: KafkaSettings) -> int:
        """Mark every (episode, verdict) already on the episodes topic; returns how many."""
        if self.bus.in_memory:
            return 0
        n = 0
        async for ep in read_topic(kafka, topic("episodes")):
            for comp in ep.rewards:
                await self.done.mark(emitted_key(ep.episode_id, comp.source))
                n += 1
        return n


async def run(settings: EpisodeSettings, stop: asyncio.Event | None = None) -> None:
    """Consume until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from services.common.bus import ensure_topics
    from services.common.idempotency import key_store
    from services.episodes.rebuild import rebuild_join_state
    from services.episodes.state import MemoryJoinStore, RedisJoinStore

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ns = settings.kafka.topic_namespace
    prefix = f"fanroute:{ns}episodes:{settings.group_id}"
    state = (MemoryJoinStore() if settings.redis.url == "memory://"
             else RedisJoinStore(settings.redis.url, prefix, settings.trace_ttl_s))
    bus = Bus(settings.kafka, client_id="fanroute-episodes")
    builder = EpisodeBuilder(bus, state, key_store(settings.redis.url, prefix))
    # One group per topic: members of one group with different subscriptions confuse assignors.
    bus.subscribe(topic("traces"), builder.on_trace, group_id=f"{settings.group_id}.traces")
    bus.subscribe(topic("verdicts"), builder.on_verdict, group_id=f"{settings.group_id}.verdicts")
    specs = [topic(n) for n in ("traces", "verdicts", "episodes", "tasks")]
    if settings.kafka.ensure_topics and not bus.in_memory:
        await ensure_topics(settings.kafka, [(bus.name(s), s) for s in specs])
    found = await builder.reconcile(settings.kafka)  # before consuming (see EpisodeBuilder)
    builder.done.rebuild = lambda: builder.reconcile(settings.kafka)  # marks gone (FLUSHALL): rebuilt first
    await builder.done.arm()
    builder.rebuild_state = lambda: rebuild_join_state(settings.kafka, state, settings.trace_ttl_s)
    async with builder._lock:
        await builder.check_state()  # a Redis that came back empty while the builder was down
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=builder.metrics.registry)
    await bus.start()
    log.info("episode builder consuming traces+verdicts as %s (%d episode components already out)",
             settings.group_id, found)
    try:
        await stop.wait()
    finally:
        await bus.stop()
        await state.close()
        await builder.done.close()
