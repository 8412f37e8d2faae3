"""OPSD on the real stack: episodes and verdicts on Kafka → ``opsd`` for a few steps with the real
SmolLM2 against the real CPU sampler → every step's adapter is published (the Redis stamp advances
each step) and pulled by the sampler before the next batch samples from it; KL and the
train–inference mismatch are logged, the mismatch on the first step is below 0.03."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from schemas import topic
from services.common.bus import Bus
from services.common.publisher_client import PublisherClient
from services.common.settings import KafkaSettings, RedisSettings
from services.episodes.build import build_episode
from services.models.prepare import DEFAULT_BASE, resolve_base
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from services.trainer.opsd import train_opsd
from services.trainer.settings import TrainerSettings
from tests.support.poll import eventually
from tests.support.records import judged_trace, verdict_for
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]


class StampingPublisher:
    """The real publisher client, reading the Redis version stamp back after every publish."""

    def __init__(self, url: str) -> None:
        self.client, self.stamps = PublisherClient(url), []

    def publish(self, model_id, adapter_dir, base_model, metrics):
        published = self.client.publish(model_id, adapter_dir, base_model, metrics)
        self.stamps.append(self.client.stamp(model_id))
        return published


async def test_opsd_publishes_every_step_and_the_sampler_serves_it(kafka_bootstrap, redis_url, tmp_path):
    base = resolve_base(DEFAULT_BASE, prepare=True)  # the real SmolLM2 (prepared once, cached)
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"o{uuid.uuid4().hex[:8]}.")
    redis = RedisSettings(url=redis_url)
    bus = Bus(kafka)
    await bus.start((topic("episodes"), topic("verdicts"), topic("adapters")))
    try:
        for i in range(4):
            verdict = verdict_for(f"t{i}")
            await bus.publish(topic("verdicts"), verdict)
            await bus.publish(topic("episodes"), build_episode(judged_trace(f"t{i}"), verdict))
    finally:
        await bus.stop()
    as_of = datetime.now(UTC)
    pport, sport = free_port(), free_port()
    purl = f"http://127.0.0.1:{pport}"
    services = contextlib.AsyncExitStack()
    await services.enter_async_context(served(publisher_app(PublisherSettings(
        kafka=kafka, redis=redis, port=pport, storage_dir=tmp_path / "store", public_url=purl)), pport,
        what="publisher", start_timeout_s=120))
    await services.enter_async_context(served(sampler_app(SamplerSettings(
        kafka=kafka, redis=redis, port=sport, base_model=str(base), adapter_cache_dir=tmp_path / "cache",
        publisher_url=purl, group_id="sampler-opsd")), sport, what="sampler", start_timeout_s=180))
    publisher = StampingPublisher(purl)
    lines: list[str] = []
    try:
        settings = TrainerSettings(
            kafka=kafka, redis=redis, base_model=str(base), output_dir=tmp_path / "run", as_of=as_of,
            allow_uncalibrated=True, max_steps=3, batch_size=2, max_tokens=512, eval_every=0, eval_fraction=0.0,
            checkpoint_every=0, publisher_url=purl, model_id="router", lora={"dropout": 0.05}, lr=1e-3,
            run={"type": "opsd", "sampler_url": f"http://127.0.0.1:{sport}", "group_size": 2, "max_new_tokens": 32})
        result = await asyncio.to_thread(train_opsd, settings, publisher=publisher, out=lines.append)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sport}", timeout=60) as client:
            async def pulled():  # the adapters topic brought the last version too, not only on-demand fetches
                return "router@3" in {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
            await eventually(pulled, timeout_s=120, what="the sampler to pull router@3 from the adapters topic")
    finally:
        await services.aclose()
        publisher.client.close()
    print(*lines, sep="\n")
    assert result.trained and result.steps == 2  # 4 episodes, 2 per batch: one pass is 2 steps, not 3
    assert publisher.stamps == [1, 2, 3]  # the initial adapter, then one version per step
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "kl" in r and "event" not in r]
    assert [(r["sampled_version"], r["trained_version"], r["staleness"]) for r in steps] == [(1, 2, 0), (2, 3, 0)]
    for r in steps:
        assert r["kl"] == r["kl"] and r["samples"] == 4 and r["completion_tokens"] > 0
    assert steps[0]["mismatch"] < 0.03, steps[0]  # fp32 on both sides and no dropout in the trainer's forward
    assert any("one pass over 4 training episodes at 2 per batch is 2 steps; stopping after 2" in ln for ln in lines)
