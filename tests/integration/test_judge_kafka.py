"""The judge worker against real Kafka and Redis: gateway traces become verdicts; a kill -9 and a
restart lose no trace and duplicate no verdict; a replay is not judged again; a new judge adds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

from schemas import Verdict, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings, RedisSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.judge.settings import JudgeSettings, build_backend
from services.judge.settings_backends import OpenAIJudgeConfig
from services.judge.settings_local import LocalJudgeConfig
from services.judge.worker import judge_key, verdict_id
from services.judge.worker import run as run_judge
from services.providers.config import BM25Config
from tests.integration.llm_judge_fake import AutoJudgeServer
from tests.support.fault_matrix import exactly_once, test_id
from tests.support.poll import eventually
from tests.support.processes import ROOT, running, service_env
from tests.support.records import judged_trace
from tests.support.topics import group_caught_up, topic_records, wait_for_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
TRACE_PROVIDERS = [BM25Config(name=n) for n in ("bm25-all", "dense-all", "eng-bm25", "lib-bm25")]


async def _verdicts(kafka: KafkaSettings) -> list[Verdict]:
    return await topic_records(kafka, "verdicts", Verdict)


def _ns() -> str:
    return f"j{uuid.uuid4().hex[:8]}."


@pytest.mark.slow
async def test_gateway_traces_become_verdicts(kafka_bootstrap, redis_url):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=_ns())
    providers = [BM25Config(name="bm25-small", collections=("adi", "med")),
                 BM25Config(name="med-only", collections=("med",)),
                 BM25Config(name="adi-only", collections=("adi",))]
    gw_settings = GatewaySettings(kafka=kafka, providers=providers)
    gw = build_gateway(gw_settings)
    await gw.start()
    queries = ["the crystalline lens in vertebrates", "computer-based information retrieval systems",
               "cancer of the lung in smokers"]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw_settings, gateway=gw)),
                                     base_url="http://gw") as client:
            ids = [(await client.post("/v1/search", json={"query": q})).json()["trace_id"] for q in queries]
    finally:
        await gw.stop()
    settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis_url), sample_rate=1.0,
                             providers=providers, judge=LocalJudgeConfig())
    stop = asyncio.Event()
    judging = asyncio.create_task(run_judge(settings, stop))
    try:
        verdicts = await wait_for_records(kafka, "verdicts", Verdict, 3, timeout_s=120, what="three verdicts")
    finally:
        stop.set()
        await judging
    assert sorted(v.trace_id for v in verdicts) == sorted(ids)
    for v in verdicts:
        assert v.status == "ok" and v.sampled_because in ("contested", "sampled")
        assert {g.provider for g in v.grades} == {"bm25-small", "med-only", "adi-only"}
        assert all(0 <= g.grade <= 3 for g in v.grades)
        assert sorted(p for tier in v.ordering for p in tier) == ["adi-only", "bm25-small", "med-only"]
        assert {v.letters[g.letter] for g in v.grades if g.letter} == {g.provider for g in v.grades if g.letter}
        assert v.rubric_hash == build_backend(LocalJudgeConfig()).rubric and v.judge_kind == "local" and v.judge_model


def _judge_env(kafka: KafkaSettings, redis_url: str, llm: AutoJudgeServer, model: str) -> dict[str, str]:
    return service_env(kafka, redis_url, FANROUTE_SAMPLE_RATE="1.0",
                       FANROUTE_PROVIDERS=json.dumps([p.model_dump() for p in TRACE_PROVIDERS]),
                       FANROUTE_JUDGE=json.dumps({"type": "openai", "base_url": llm.base_url, "model": model,
                                                  "backoff_s": 0.01}))


def _judge(env: dict[str, str], *, crash: bool = False):
    return running("-m", "services.judge", env=env, crash=crash)


@pytest.mark.slow
async def test_kill_restart_replay_and_a_new_judge(kafka_bootstrap, redis_url, request):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=_ns())
    bus = Bus(kafka)
    await bus.start((topic("traces"), topic("verdicts")))
    traces = [judged_trace(f"trace-{i:03d}", contested=i % 2 == 0) for i in range(40)]
    try:
        for t in traces:
            await bus.publish(topic("traces"), t)
        with AutoJudgeServer(delay_s=0.05) as llm:
            env = _judge_env(kafka, redis_url, llm, "judge-llm-a")
            backend = build_backend(OpenAIJudgeConfig(base_url=llm.base_url, model="judge-llm-a"))
            group = "judge." + judge_key(backend, backend.rubric)
            with _judge(env, crash=True):
                await wait_for_records(kafka, "verdicts", Verdict, 8, timeout_s=120,
                                       what="8 verdicts before the kill")
            before_kill = len(await _verdicts(kafka))
            assert before_kill < len(traces), "the kill must land mid-stream"
            with _judge(env):
                await eventually(lambda: group_caught_up(kafka, group), timeout_s=180,
                                 what="the restarted judge to catch up")
                after_restart = await _verdicts(kafka)
                for t in traces:  # replay every trace: none may be judged again
                    await bus.publish(topic("traces"), t)
                await eventually(lambda: group_caught_up(kafka, group), timeout_s=120,
                                 what="the judge to read the replay")
                after_replay = await _verdicts(kafka)
            with _judge(_judge_env(kafka, redis_url, llm, "judge-llm-b")):  # a different judge
                await wait_for_records(kafka, "verdicts", Verdict, 2 * len(traces), timeout_s=180,
                                       what="the second judge's verdicts")
            prompts = llm.prompts
    finally:
        await bus.stop()
    exactly_once("kill -9 mid-stream, restart (then every trace replayed)", "judge",
                 test_id(request), records_in=2 * len(traces),
                 expected={verdict_id(t.trace_id, backend, backend.rubric) for t in traces},
                 results=[v.verdict_id for v in after_replay], before_kill=before_kill)
    assert {v.trace_id for v in after_restart} == {t.trace_id for t in traces}
    key = lambda v: v.verdict_id  # noqa: E731 — partitions are read in no fixed order
    assert sorted(after_replay, key=key) == sorted(after_restart, key=key)
    assert {v.sampled_because for v in after_restart} == {"contested", "sampled"}
    final = await _verdicts(kafka)
    by_model = {m: [v for v in final if v.judge_model == m] for m in ("judge-llm-a", "judge-llm-b")}
    assert len(by_model["judge-llm-b"]) == len(traces)  # beside the first judge's, not over them
    assert sorted(by_model["judge-llm-a"], key=key) == sorted(after_restart, key=key)
    v = by_model["judge-llm-a"][0]
    assert {g.provider: g.grade for g in v.grades} == {"bm25-all": 3, "dense-all": 1, "eng-bm25": 3,
                                                       "lib-bm25": 0}
    assert all(name not in p for p in prompts for name in ("bm25-all", "dense-all", "eng-bm25", "lib-bm25"))


async def test_judge_that_is_a_provider_refuses_to_start():
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "FANROUTE_PROVIDERS": json.dumps([p.model_dump() for p in TRACE_PROVIDERS]),
           "FANROUTE_JUDGE": json.dumps({"type": "openai", "base_url": "http://127.0.0.1:9/v1",
                                         "model": "dense-all"})}
    proc = subprocess.run([sys.executable, "-m", "services.judge"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr and "is provider 'dense-all'" in proc.stderr


async def test_sampling_on_the_real_topic_judges_contested_and_counts_the_rest(kafka_bootstrap, redis_url):
    import redis.asyncio as redis

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=_ns())
    bus = Bus(kafka)
    await bus.start((topic("traces"), topic("verdicts")))
    calm = [judged_trace(f"calm-{i}", contested=False) for i in range(10)]
    hot = [judged_trace(f"hot-{i}", contested=True) for i in range(2)]
    try:
        for t in calm + hot + calm:  # the calm ones twice: counted once
            await bus.publish(topic("traces"), t)
    finally:
        await bus.stop()
    settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis_url), sample_rate=0.0,
                             providers=TRACE_PROVIDERS, judge=LocalJudgeConfig())
    backend = build_backend(settings.judge)
    group = f"judge.{judge_key(backend, backend.rubric)}"
    stop = asyncio.Event()
    judging = asyncio.create_task(run_judge(settings, stop))
    try:
        await eventually(lambda: group_caught_up(kafka, group), timeout_s=120,
                         what="the judge to read every trace")
    finally:
        stop.set()
        await judging
    verdicts = await _verdicts(kafka)
    assert sorted(v.trace_id for v in verdicts) == ["hot-0", "hot-1"]
    assert {v.sampled_because for v in verdicts} == {"contested"}
    client = redis.Redis.from_url(redis_url)
    try:
        key = f"fanroute:{kafka.topic_namespace}judge:{judge_key(backend, backend.rubric)}:unsampled"
        assert await client.scard(key) == 10
    finally:
        await client.aclose()
