"""Redis FLUSHALL under the judge and the episode builder (real broker, a redis-server of the test's own):
after the flush every record is replayed beside new ones, and no result comes out twice.

Their idempotency marks live in Redis. Before the key store noticed a flush (its ``intact`` key, read with
each mark, and the marks rebuilt from the output topic: :mod:`services.common.idempotency`), every replayed
record after the flush was a second verdict or episode: 20 duplicates in each test below.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

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
from tests.integration.test_fault_redis import PROVIDERS
from tests.support.fault_matrix import exactly_once, test_id
from tests.support.poll import eventually
from tests.support.records import judged_trace, verdict_for
from tests.support.redis_server import RedisServer
from tests.support.topics import group_caught_up, topic_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]
N = 20  # records before the flush; as many new ones after it, with every earlier one replayed


def _kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"fl{uuid.uuid4().hex[:8]}.")


async def _publish(kafka: KafkaSettings, records: list[tuple[str, object]]) -> None:
    bus = Bus(kafka)
    await bus.start(tuple(topic(n) for n in ("traces", "verdicts", "episodes", "tasks")))
    try:
        for name, record in records:
            await bus.publish(topic(name), record)
    finally:
        await bus.stop()


async def _flush_between(redis_url: str, service: Callable[[asyncio.Event], Awaitable[None]],
                         caught_up: Callable[[], Awaitable[bool]], after_flush: Callable[[], Awaitable[None]]) -> int:
    """Run ``service`` until it caught up, FLUSHALL its Redis, publish ``after_flush``, wait until it caught
    up again; returns how many keys Redis held right before the flush."""
    stop = asyncio.Event()
    running = asyncio.create_task(service(stop))
    client = aioredis.Redis.from_url(redis_url)
    try:
        await eventually(caught_up, timeout_s=90, what="the consumer to catch up before the flush")
        keys = await client.dbsize()
        await client.flushall()
        await after_flush()
        await eventually(caught_up, timeout_s=90, what="the consumer to catch up after the flush")
    finally:
        stop.set()
        await running
        await client.aclose()
    return keys


async def test_flushall_under_the_judge_judges_no_trace_twice(kafka_bootstrap, tmp_path, request):
    kafka = _kafka(kafka_bootstrap)
    before = [judged_trace(f"trace-{i:03d}", contested=True) for i in range(N)]
    after = [judged_trace(f"late-{i:03d}", contested=True) for i in range(N)]
    backend = build_backend(LocalJudgeConfig())
    group = f"judge.{judge_key(backend, backend.rubric)}"
    with RedisServer(tmp_path / "redis") as redis:
        await _publish(kafka, [("traces", t) for t in before])
        settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis.url), sample_rate=1.0,
                                 providers=PROVIDERS, judge=LocalJudgeConfig())
        keys = await _flush_between(redis.url, lambda stop: run_judge(settings, stop),
                                    lambda: group_caught_up(kafka, group),
                                    lambda: _publish(kafka, [("traces", t) for t in after + before]))
    verdicts = await topic_records(kafka, "verdicts", Verdict)
    exactly_once("Redis FLUSHALL mid-flow; then every earlier trace replayed beside new ones", "judge",
                 test_id(request), records_in=3 * N,
                 expected={verdict_id(t.trace_id, backend, backend.rubric) for t in before + after},
                 results=[v.verdict_id for v in verdicts], redis_keys_flushed=keys)
    assert keys >= N  # the marks were really there, and really flushed


async def test_flushall_under_the_builder_builds_no_episode_twice(kafka_bootstrap, tmp_path, request):
    kafka = _kafka(kafka_bootstrap)
    before, after = [f"t{i:03d}" for i in range(N)], [f"u{i:03d}" for i in range(N)]

    def joined(ids: list[str]) -> list[tuple[str, object]]:
        return [*(("traces", judged_trace(t)) for t in ids), *(("verdicts", verdict_for(t)) for t in ids)]

    with RedisServer(tmp_path / "redis") as redis:
        await _publish(kafka, joined(before))
        settings = EpisodeSettings(kafka=kafka, redis=RedisSettings(url=redis.url))

        async def caught_up() -> bool:
            return all([await group_caught_up(kafka, f"{settings.group_id}.{name}", name)
                        for name in ("traces", "verdicts")])

        keys = await _flush_between(redis.url, lambda stop: run_builder(settings, stop), caught_up,
                                    lambda: _publish(kafka, joined(after) + joined(before)))
    episodes = await topic_records(kafka, "episodes", Episode)
    exactly_once("Redis FLUSHALL mid-flow; then every earlier trace and verdict replayed beside new ones",
                 "episode builder", test_id(request), records_in=6 * N,
                 expected={episode_id(t) for t in before + after}, results=[e.episode_id for e in episodes],
                 redis_keys_flushed=keys)
    assert keys >= N


async def test_flushall_with_joins_half_done_loses_no_episode_and_keeps_the_first_verdict(kafka_bootstrap, tmp_path,
                                                                                         request):
    """Traces waiting for their verdicts, verdicts waiting for their traces, and episodes a later verdict
    extends — all in the join state when Redis is flushed. Before the builder rebuilt its join state from
    the topics (services/episodes/rebuild.py) every one of the first two kinds was lost (40 here), and the
    later verdict rebuilt its episode around itself."""
    kafka = _kafka(kafka_bootstrap)
    waiting_trace, waiting_verdict, done = ([f"{p}{i:03d}" for i in range(N)] for p in "abc")
    second = {t: verdict_for(t, model="judge-b", grades={"bm25-all": 1, "dense-all": 3, "eng-bm25": 0,
                                                         "lib-bm25": 0}) for t in done}
    with RedisServer(tmp_path / "redis") as redis:
        await _publish(kafka, [*(("traces", judged_trace(t)) for t in waiting_trace + done),
                               *(("verdicts", verdict_for(t)) for t in waiting_verdict + done)])
        settings = EpisodeSettings(kafka=kafka, redis=RedisSettings(url=redis.url))

        async def caught_up() -> bool:
            return all([await group_caught_up(kafka, f"{settings.group_id}.{name}", name)
                        for name in ("traces", "verdicts")])

        keys = await _flush_between(redis.url, lambda stop: run_builder(settings, stop), caught_up, lambda: _publish(
            kafka, [*(("verdicts", verdict_for(t)) for t in waiting_trace), *(("traces", judged_trace(t))
                                                                              for t in waiting_verdict),
                    *(("verdicts", second[t]) for t in done)]))
    episodes = await topic_records(kafka, "episodes", Episode)
    first_of = [e for e in episodes if e.trace_id not in done or len(e.rewards) == 1]
    exactly_once("Redis FLUSHALL with joins half done (traces and verdicts waiting for each other)",
                 "episode builder", test_id(request), records_in=6 * N,
                 expected={episode_id(t) for t in waiting_trace + waiting_verdict + done},
                 results=[e.episode_id for e in first_of], redis_keys_flushed=keys)
    latest = {e.trace_id: e for e in episodes if e.trace_id in done}
    assert all(len(e.rewards) == 2 for e in latest.values())  # the second judge's component joined the first
    first = verdict_for(done[0]).ordering
    assert all(e.messages[2].content.startswith(" = ".join(first[0])) for e in latest.values()), \
        "the assistant turn stays the first verdict's ordering"
