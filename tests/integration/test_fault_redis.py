"""Fault matrix, Redis rows: the Redis that the judge and the episode builder keep their idempotency
keys and join state in is stopped and started again mid-stream (real broker, a redis-server of the
test's own, append-only like compose's).

The stop lands at the worst moment, injected at a known point: right after the consumer's Nth result
is acknowledged by Kafka and before the consumer marks it done in Redis. The handler's mark fails,
the bus retries the record in place until Redis is back, and the retry must not publish the result
a second time. Results are counted by record and by content-derived id (tests/support/fault_matrix).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

import pytest

from schemas import Episode, Verdict, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings, RedisSettings
from services.episodes.build import episode_id
from services.episodes.settings import EpisodeSettings
from services.episodes.worker import run as run_builder
from services.judge.settings import JudgeSettings, build_backend
from services.judge.settings_local import LocalJudgeConfig
from services.judge.worker import judge_key, verdict_id
from services.judge.worker import run as run_judge
from services.providers.config import BM25Config
from tests.support.fault_matrix import exactly_once, test_id
from tests.support.poll import eventually
from tests.support.records import judged_trace, verdict_for
from tests.support.redis_server import RedisServer
from tests.support.topics import group_caught_up, topic_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]
PROVIDERS = [BM25Config(name=n) for n in ("bm25-all", "dense-all", "eng-bm25", "lib-bm25")]
FAULT_AT = 10  # Redis stops right after the 10th result is acknowledged
N = 40


def _kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"fr{uuid.uuid4().hex[:8]}.",
                         transient_backoff_initial_s=0.05, transient_backoff_max_s=0.5, transient_budget_s=120)


def stop_redis_after(monkeypatch: pytest.MonkeyPatch, name: str, n: int, redis: RedisServer) -> asyncio.Event:
    """Stop ``redis`` as soon as the ``n``-th publish to topic ``name`` is acknowledged (any Bus in this
    process); the returned event is set then."""
    original: Callable = Bus.publish
    published = 0
    fired = asyncio.Event()

    async def publish(self: Bus, spec, message) -> None:
        nonlocal published
        await original(self, spec, message)
        if spec.name == name:
            published += 1
            if published == n:
                redis.stop()
                fired.set()

    monkeypatch.setattr(Bus, "publish", publish)
    return fired


def transient_retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("transient" in r.getMessage() for r in caplog.records if r.name == "services.common.bus")


async def _through_the_restart(redis: RedisServer, fired: asyncio.Event, caplog: pytest.LogCaptureFixture,
                               service: Callable[[asyncio.Event], Awaitable[None]],
                               caught_up: Callable[[], Awaitable[bool]]) -> int:
    """Run ``service`` until it has committed every record: wait for the fault, for the service to be
    retrying against the stopped Redis, start Redis again, wait; returns the retries seen while down."""
    stop = asyncio.Event()
    running = asyncio.create_task(service(stop))
    try:
        await eventually(fired.is_set, timeout_s=60, what=f"result {FAULT_AT} (Redis stops then)")
        await eventually(lambda: transient_retries(caplog) >= 3, timeout_s=30,
                         what="the consumer to retry against the stopped Redis")
        retries = transient_retries(caplog)
        redis.start()
        await eventually(caught_up, timeout_s=90, what="the consumer to commit every record after the restart")
    finally:
        stop.set()
        await running
    assert redis.starts == 2
    return retries


async def test_redis_restarted_while_the_judge_marks_a_verdict(kafka_bootstrap, tmp_path, monkeypatch, caplog, request):
    caplog.set_level(logging.WARNING, logger="services.common.bus")
    kafka = _kafka(kafka_bootstrap)
    traces = [judged_trace(f"trace-{i:03d}", contested=i % 2 == 0) for i in range(N)]
    backend = build_backend(LocalJudgeConfig())
    group = f"judge.{judge_key(backend, backend.rubric)}"
    with RedisServer(tmp_path / "redis") as redis:
        bus = Bus(kafka)
        await bus.start((topic("traces"), topic("verdicts")))
        try:
            for t in traces:
                await bus.publish(topic("traces"), t)
        finally:
            await bus.stop()
        fired = stop_redis_after(monkeypatch, "verdicts", FAULT_AT, redis)
        settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis.url), sample_rate=1.0,
                                 providers=PROVIDERS, judge=LocalJudgeConfig())
        retries = await _through_the_restart(redis, fired, caplog, lambda stop: run_judge(settings, stop),
                                             lambda: group_caught_up(kafka, group))
    verdicts = await topic_records(kafka, "verdicts", Verdict)
    exactly_once("Redis stopped (SIGTERM) after a verdict is acked, before it is marked; started again",
                 "judge", test_id(request),
                 records_in=N, expected={verdict_id(t.trace_id, backend, backend.rubric) for t in traces},
                 results=[v.verdict_id for v in verdicts], retries_while_down=retries)
    assert sorted(v.trace_id for v in verdicts) == sorted(t.trace_id for t in traces)


async def test_redis_restarted_while_the_builder_marks_an_episode(kafka_bootstrap, tmp_path, monkeypatch, caplog, request):
    caplog.set_level(logging.WARNING, logger="services.common.bus")
    kafka = _kafka(kafka_bootstrap)
    ids = [f"t{i:03d}" for i in range(N)]
    with RedisServer(tmp_path / "redis") as redis:
        bus = Bus(kafka)
        await bus.start(tuple(topic(n) for n in ("traces", "verdicts", "episodes", "tasks")))
        try:
            for i, tid in enumerate(ids):  # half the verdicts arrive before their trace
                if i % 2:
                    await bus.publish(topic("verdicts"), verdict_for(tid))
            for tid in ids:
                await bus.publish(topic("traces"), judged_trace(tid))
            for tid in ids[::2]:
                await bus.publish(topic("verdicts"), verdict_for(tid))
        finally:
            await bus.stop()
        fired = stop_redis_after(monkeypatch, "episodes", FAULT_AT, redis)
        settings = EpisodeSettings(kafka=kafka, redis=RedisSettings(url=redis.url))

        async def caught_up() -> bool:
            return all([await group_caught_up(kafka, f"{settings.group_id}.{name}", name)
                        for name in ("traces", "verdicts")])

        retries = await _through_the_restart(redis, fired, caplog, lambda stop: run_builder(settings, stop),
                                             caught_up)
    episodes = await topic_records(kafka, "episodes", Episode)
    exactly_once("Redis stopped (SIGTERM) after an episode is acked, before it is marked; started again",
                 "episode builder", test_id(request),
                 records_in=2 * N, expected={episode_id(t) for t in ids}, results=[e.episode_id for e in episodes],
                 retries_while_down=retries)
