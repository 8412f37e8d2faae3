"""``fanroute eval`` and ``fanroute promote`` on the real stack: held-out traces on the Kafka topic,
a real publisher (Kafka + Redis) and the CPU sampler serving two LoRA adapters of a tiny model.

Asked to write its ordering (``--router-mode generate``), the tiny model writes garbage, which shows up as counted fallbacks; such a candidate does not beat the
baselines and promote refuses with reasons. Fed an eval.json in which the candidate does beat them,
promote promotes: promoted=True on the adapters topic, the Redis key the gateway polls, and the
evidence beside the manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import redis.asyncio as aioredis

from schemas import AdapterPublished, topic
from services.cli import main
from services.common.bus import Bus
from services.common.dataset import write_jsonl
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import parse_promoted, promoted_key
from services.evaluate.report import read_report, write_json
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from tests.support.poll import eventually
from tests.support.records import adi, adi_trace, episode
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]


async def test_eval_then_promote(kafka_bootstrap, redis_url, tmp_path, monkeypatch, capsys):
    ns = f"ev{uuid.uuid4().hex[:8]}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns)
    redis = RedisSettings(url=redis_url)
    qids = sorted(adi()[1], key=int)
    held, trained = qids[:4], qids[4:7]
    bus = Bus(kafka)
    await bus.start((topic("traces"), topic("adapters")))
    try:
        await bus.publish(topic("traces"), adi_trace(qids[8], trace_id="before-since"))
        since = datetime.now(UTC) + timedelta(milliseconds=2)
        # the next records' timestamps are at or after `since`
        await eventually(lambda: datetime.now(UTC) >= since, timeout_s=1, what="the clock to reach `since`",
                         interval_s=0.001)
        for i, q in enumerate(held + trained):
            await bus.publish(topic("traces"), adi_trace(q, flaky_error=(i == 0)))
    finally:
        await bus.stop()
    write_jsonl([episode(adi()[0][q], "cheap > good > flaky", ("good", "cheap", "flaky"), ep_id=f"e{q}")
                 for q in trained], tmp_path / "train.jsonl")
    base = build_tiny_model(tmp_path / "base")
    adapters = [build_lora_adapter(base, tmp_path / f"adapter{v}", seed=v) for v in (1, 2)]

    pport, sport = free_port(), free_port()
    purl = f"http://127.0.0.1:{pport}"
    services = contextlib.AsyncExitStack()
    await services.enter_async_context(served(publisher_app(PublisherSettings(
        kafka=kafka, redis=redis, port=pport, storage_dir=tmp_path / "store", public_url=purl)), pport,
        what="publisher", start_timeout_s=120))
    surl = await services.enter_async_context(served(sampler_app(SamplerSettings(
        kafka=kafka, redis=redis, port=sport, base_model=str(base), adapter_cache_dir=tmp_path / "cache",
        publisher_url=purl, group_id=f"sampler-{ns}")), sport, what="sampler", start_timeout_s=120))
    r = aioredis.Redis.from_url(redis_url)
    try:
        def publish_and_deploy_v1() -> None:
            with PublisherClient(purl) as pc:
                for d in adapters:
                    pc.publish("router", d, str(base), {})
                pc.promote("router", 1, fallback_provider="cheap")  # what is deployed before the eval

        await asyncio.to_thread(publish_and_deploy_v1)
        monkeypatch.setenv("FANROUTE_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
        monkeypatch.setenv("FANROUTE_KAFKA__TOPIC_NAMESPACE", ns)
        out = tmp_path / "eval"
        code = await asyncio.to_thread(main, [
            "eval", "--candidate", "router@2", "--deployed", "auto", "--publisher-url", purl, "--router-url", surl,
            "--train-episodes", str(tmp_path / "train.jsonl"), "--router-timeout", "60", "--out", str(out),
            "--no-progress", "--bootstrap", "200", "--since", since.isoformat(),
            "--router-mode", "generate"])  # writing orderings: the tiny model's garbage (scoring: e2e/, unit tests)
        printed = capsys.readouterr()
        assert code == 0, printed.err
        report = read_report(out / "eval.json")
        i = report.inputs
        assert (i.held_out, i.traces_read, i.excluded["trained_query"]) == (4, 7, 3)
        assert i.traces_source.startswith(f"topic {ns}traces appended in [{since.isoformat()}")
        assert "before-since" not in {q.trace_id for q in report.queries}
        assert (i.deployed, i.deployed_source, i.deployed_fallback_provider) == ("router@1", "auto", "cheap")
        assert i.best_single.provider == "cheap" and i.human_queries == 4
        cand = report.policies["candidate"]
        fallbacks = sum(cand.fallbacks.values())
        assert fallbacks > 0  # the tiny model's garbage: counted, answered by the best single provider
        assert fallbacks == sum(q.outcomes["candidate"].fallback is not None for q in report.queries)
        assert (out / "cost_quality.png").is_file() and "candidate (router@2)" in printed.out

        # The garbage router does not beat the baselines: refused, with reasons, nothing promoted.
        code = await asyncio.to_thread(main, ["promote", "--candidate", "router@2", "--publisher-url", purl,
                                              "--eval", str(out / "eval.json")])
        printed = capsys.readouterr()
        assert code == 3, printed.out + printed.err
        assert "REFUSED router@2" in printed.out and "does not beat" in printed.out
        decision = json.loads((out / "decision.json").read_text())
        assert decision["decision"] == "refuse" and decision["reasons"]
        assert "reliability" in decision["decided_by"]  # its answers were mostly the fallback provider's
        assert parse_promoted(await r.get(promoted_key(ns, "router"))) == (1, "cheap")

        # An eval in which the candidate decides and beats both baselines on both measures: promoted.
        better = report.model_copy(update={"policies": {**report.policies, "candidate": cand.model_copy(update={
            "fallbacks": {}, "human": cand.human.model_copy(update={"mean": 0.99}),
            "judge": cand.judge.model_copy(update={"mean": 2.99})})}})
        good_eval = write_json(better, tmp_path / "eval-better")
        code = await asyncio.to_thread(main, ["promote", "--candidate", "router@2", "--publisher-url", purl,
                                              "--eval", str(good_eval)])
        printed = capsys.readouterr()
        assert code == 0, printed.out + printed.err
        assert "PROMOTE router@2" in printed.out
        assert parse_promoted(await r.get(promoted_key(ns, "router"))) == (2, "cheap")
        async with httpx.AsyncClient(base_url=purl) as client:
            record = (await client.get("/v1/adapters/router/promoted")).json()
        assert record["version"] == 2 and record["fallback_provider"] == "cheap"
        assert record["evidence"]["decision"]["decision"] == "promote"
        assert record["evidence"]["eval"]["inputs"]["candidate"] == "router@2"
        assert json.loads((tmp_path / "eval-better" / "decision.json").read_text())["promoted"] is True
        messages = [m async for m in read_topic(kafka, topic("adapters"), model=AdapterPublished, strict=True)]
        assert [(m.version, m.promoted, m.fallback_provider) for m in messages if m.promoted] == [
            (1, True, "cheap"), (2, True, "cheap")]
    finally:
        await r.aclose()
        await services.aclose()
