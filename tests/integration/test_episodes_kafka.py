"""Episodes on real Kafka and Redis: the running pipeline (gateway → judge → builder) yields
episodes, ATIF files and replay tasks; the builder survives kill -9; datasets as of T reproduce."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from schemas import Episode, Task, topic
from services.common.bus import Bus
from services.common.dataset import dataset_as_of, write_jsonl
from services.common.settings import KafkaSettings, RedisSettings
from services.episodes.atif import write_atif
from services.episodes.build import episode_id
from services.episodes.settings import EpisodeSettings
from services.episodes.tasks import write_task
from services.episodes.verifier import run_verifier
from services.episodes.worker import run as run_builder
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.judge.settings import JudgeSettings
from services.judge.settings_local import LocalJudgeConfig
from services.judge.worker import run as run_judge
from services.providers.config import BM25Config
from tests.support.fault_matrix import exactly_once, test_id
from tests.support.poll import eventually
from tests.support.processes import running, service_env
from tests.support.records import judged_trace, verdict_for
from tests.support.topics import topic_records, wait_for_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def _kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"e{uuid.uuid4().hex[:8]}.")


@pytest.mark.slow
async def test_gateway_judge_builder_pipeline_yields_episodes_atif_and_tasks(kafka_bootstrap, redis_url, tmp_path):
    kafka = _kafka(kafka_bootstrap)
    redis = RedisSettings(url=redis_url)
    providers = [BM25Config(name="bm25-small", collections=("adi", "med")),
                 BM25Config(name="med-only", collections=("med",)),
                 BM25Config(name="adi-only", collections=("adi",))]
    stop = asyncio.Event()
    services = [asyncio.create_task(run_judge(JudgeSettings(kafka=kafka, redis=redis, sample_rate=1.0,
                                                            providers=providers,
                                                            judge=LocalJudgeConfig()), stop)),
                asyncio.create_task(run_builder(EpisodeSettings(kafka=kafka, redis=redis), stop))]
    gw_settings = GatewaySettings(kafka=kafka, providers=providers)
    gw = build_gateway(gw_settings)
    await gw.start()
    queries = {"med/1": "the crystalline lens in vertebrates, including humans",
               "adi/1": "What problems and concerns are there in making up descriptive titles?"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw_settings, gateway=gw)),
                                     base_url="http://gw") as client:
            for qid, q in queries.items():
                assert (await client.post("/v1/search", json={"query": q, "query_id": qid})).status_code == 200
        episodes = await wait_for_records(kafka, "episodes", Episode, 2, timeout_s=180, what="two episodes")
        tasks = await wait_for_records(kafka, "tasks", Task, 2, timeout_s=60, what="two tasks")
    finally:
        await gw.stop()
        stop.set()
        await asyncio.gather(*services)
    assert {e.messages[1].content for e in episodes} == set(queries.values())
    for ep in episodes:
        assert ep.messages[0].role == "system" and "bm25-small" in ep.messages[0].content
        assert ep.rewards and ep.rewards[0].name.startswith("ndcg:local-lexical")
        path = write_atif(ep, tmp_path / "atif")
        assert json.loads(path.read_text())["session_id"] == ep.episode_id
    for task in tasks:
        task_dir = write_task(task, tmp_path / "tasks")
        [ep] = [e for e in episodes if e.trace_id == task.trace_id]
        result = run_verifier(task_dir, ep.messages[2].content)  # the judge's own ordering
        assert result.source == "reward.txt" and not result.flagged
        assert result.reward == pytest.approx(ep.rewards[0].value)
        assert run_verifier(task_dir, "nonsense > answer").reward == 0.0


def _builder(kafka: KafkaSettings, redis_url: str, *, crash: bool = False):
    return running("-m", "services.episodes", env=service_env(kafka, redis_url), crash=crash)


@pytest.mark.slow
async def test_builder_killed_and_restarted_loses_and_duplicates_nothing(kafka_bootstrap, redis_url, request):
    kafka = _kafka(kafka_bootstrap)
    bus = Bus(kafka)
    await bus.start(tuple(topic(n) for n in ("traces", "verdicts", "episodes", "tasks")))
    n = 60
    try:
        for i in range(n):  # half the verdicts arrive before their trace
            if i % 2:
                await bus.publish(topic("verdicts"), verdict_for(f"t{i:03d}"))
        for i in range(n):
            await bus.publish(topic("traces"), judged_trace(f"t{i:03d}"))
        for i in range(0, n, 2):
            await bus.publish(topic("verdicts"), verdict_for(f"t{i:03d}"))
        with _builder(kafka, redis_url, crash=True):
            await wait_for_records(kafka, "episodes", Episode, 5, timeout_s=120,
                                   what="5 episodes before the kill")
        before_kill = len(await topic_records(kafka, "episodes", Episode))
        assert before_kill < n, "the kill must land mid-stream"
        with _builder(kafka, redis_url):
            episodes = await wait_for_records(kafka, "episodes", Episode, n, timeout_s=180, what="every episode")
            await wait_for_records(kafka, "tasks", Task, n, timeout_s=60, what="every task")
            for i in range(n):  # a replay of every verdict: nothing new may appear
                await bus.publish(topic("verdicts"), verdict_for(f"t{i:03d}"))
            await bus.publish(topic("traces"), judged_trace("sentinel"))
            await bus.publish(topic("verdicts"), verdict_for("sentinel"))
            await wait_for_records(kafka, "episodes", Episode, n + 1, timeout_s=120,
                                   what="the sentinel's episode")
    finally:
        await bus.stop()
    episodes = await topic_records(kafka, "episodes", Episode)
    exactly_once("kill -9 mid-stream, restart (then every verdict replayed)", "episode builder",
                 test_id(request),
                 records_in=3 * n + 2, expected={episode_id(f"t{i:03d}") for i in range(n)} | {episode_id("sentinel")},
                 results=[e.episode_id for e in episodes], before_kill=before_kill)
    # tasks are at least once (a kill between a task and its episode repeats that task record,
    # same content, same id): one distinct task per episode
    tasks = await topic_records(kafka, "tasks", Task)
    assert len({t.task_id for t in tasks}) == n + 1 and len(tasks) <= n + 2


async def test_dataset_as_of_is_reproducible_byte_for_byte(kafka_bootstrap, tmp_path):
    kafka = _kafka(kafka_bootstrap)
    bus = Bus(kafka)
    await bus.start((topic("episodes"),))
    from tests.support.records import all_examples

    base = next(m for m in all_examples() if isinstance(m, Episode))
    try:
        for i in range(5):
            await bus.publish(topic("episodes"), base.model_copy(update={"episode_id": f"e{4 - i}"}))
        as_of = datetime.now(UTC)
        # record timestamps are whole ms: the next ones must land after T
        await eventually(lambda: datetime.now(UTC).timestamp() * 1000 >= as_of.timestamp() * 1000 + 2,
                         timeout_s=1, what="the clock to pass T by 2 ms", interval_s=0.001)
        first = write_jsonl(await dataset_as_of(kafka, as_of), tmp_path / "a.jsonl")
        extra = base.rewards[0].model_copy(update={"component_id": "c2", "name": "ndcg:other"})
        for i in range(3):  # more episodes, and a new component for an old one, after T
            await bus.publish(topic("episodes"), base.model_copy(update={"episode_id": f"later{i}"}))
        await bus.publish(topic("episodes"), base.model_copy(update={"episode_id": "e0",
                                                                     "rewards": base.rewards + (extra,)}))
        again = write_jsonl(await dataset_as_of(kafka, as_of), tmp_path / "b.jsonl")
        now = await dataset_as_of(kafka, datetime.now(UTC))
    finally:
        await bus.stop()
    assert first.read_bytes() == again.read_bytes()
    assert [json.loads(line)["episode_id"] for line in first.read_text().splitlines()] == [f"e{i}" for i in range(5)]
    assert len(now) == 8
    assert {c.name for c in next(e for e in now if e.episode_id == "e0").rewards} == {"ndcg", "ndcg:other"}
