"""The student exists: episodes on the real topic → trainer → publisher → the sampler pulls the
adapter over HTTP and serves it under its model id; the Redis stamp moved; the completion's token
ids and logprobs match a direct transformers forward pass of the same adapter."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from schemas import topic
from services.common.bus import Bus
from services.common.publisher_client import PublisherClient
from services.common.settings import KafkaSettings, RedisSettings
from services.episodes.build import build_episode
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from services.trainer.settings import TrainerSettings
from services.trainer.train import train
from tests.support.poll import eventually
from tests.support.records import judged_trace, verdict_for
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_tiny_model

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]


def _direct_logprobs(base_dir, adapter_dir, ids: list[int], n_prompt: int) -> list[float]:
    """Teacher-forced log-softmax of each generated token under base + adapter (transformers + peft)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      adapter_dir).eval()
    with torch.no_grad():
        logits_TV = model(torch.tensor([ids])).logits[0]
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    return [float(logp_TV[t - 1, ids[t]]) for t in range(n_prompt, len(ids))]


async def test_episodes_to_a_served_adapter(kafka_bootstrap, redis_url, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"s{uuid.uuid4().hex[:8]}.")
    redis = RedisSettings(url=redis_url)
    base = build_tiny_model(tmp_path / "base")
    bus = Bus(kafka)
    await bus.start((topic("episodes"), topic("adapters")))
    try:
        for i in range(8):
            await bus.publish(topic("episodes"), build_episode(judged_trace(f"t{i}"), verdict_for(f"t{i}")))
    finally:
        await bus.stop()
    as_of = datetime.now(UTC)
    pport, sport = free_port(), free_port()
    pub_settings = PublisherSettings(kafka=kafka, redis=redis, port=pport, storage_dir=tmp_path / "store",
                                     public_url=f"http://127.0.0.1:{pport}")
    samp_settings = SamplerSettings(kafka=kafka, redis=redis, port=sport, base_model=str(base),
                                    adapter_cache_dir=tmp_path / "cache", publisher_url=f"http://127.0.0.1:{pport}",
                                    group_id="sampler-test")
    services = contextlib.AsyncExitStack()
    await services.enter_async_context(served(publisher_app(pub_settings), pport, what="publisher",
                                              start_timeout_s=120))
    await services.enter_async_context(served(sampler_app(samp_settings), sport, what="sampler",
                                              start_timeout_s=120))
    try:
        settings = TrainerSettings(kafka=kafka, redis=redis, base_model=str(base), output_dir=tmp_path / "run",
                                   as_of=as_of, allow_uncalibrated=True, max_steps=3, batch_size=2,
                                   max_tokens=256, eval_every=0, eval_fraction=0.0, checkpoint_every=0,
                                   publisher_url=f"http://127.0.0.1:{pport}", model_id="router")
        result = await asyncio.to_thread(train, settings)
        assert result.trained
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sport}", timeout=60) as client:
            async def loaded():
                ids = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
                return "router@1" in ids
            await eventually(loaded, timeout_s=120, what="the sampler to pull and load router@1")
            r = await client.post("/v1/completions", json={
                "model": "router@1", "prompt": "which provider for boundary layers?", "max_tokens": 6,
                "temperature": 0, "logprobs": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        prompt_ids, out_ids = r.json().get("prompt_token_ids") or choice["prompt_token_ids"], choice["token_ids"]
        served_logprobs = choice["logprobs"]["token_logprobs"]
        def fetch():  # the client is synchronous: off the loop that serves the publisher
            with PublisherClient(f"http://127.0.0.1:{pport}") as pc:
                return pc.stamp("router"), pc.fetch_version("router", 1, tmp_path / "fetched")

        stamp, adapter = await asyncio.to_thread(fetch)
        assert stamp == 1  # the Redis version stamp moved
    finally:
        await services.aclose()
    direct = _direct_logprobs(base, adapter, list(prompt_ids) + list(out_ids), len(prompt_ids))
    assert len(out_ids) == len(served_logprobs) == len(direct) > 0
    assert served_logprobs == pytest.approx(direct, abs=1e-4)
