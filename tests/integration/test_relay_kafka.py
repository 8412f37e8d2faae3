"""The relay on the real broker and redis-server, in front of the real CPU sampler serving a LoRA adapter
(the adapter's Redis stamp says which version samples): the official OpenAI and Anthropic SDKs hold
multi-turn conversations (sync and streaming) with tokens minted by ``fanroute credentials mint``; the
``calls`` records on the topic and the folded datums match a direct transformers + peft forward pass
(1e-4); a history rewrite gives two segments; refused credentials never reach the sampler."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import uuid

import anthropic
import httpx
import openai
import pytest

from schemas import Call, topic
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import RedisStampStore
from services.relay import cli as relay_cli
from services.relay.settings import RelaySettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from tests.support.poll import eventually
from tests.support.relay import relay_served
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]
ADMIN = "integration-admin-token"
TOL = 1e-4


def forward_logprobs(base, adapter, tokens: list[int]) -> list[float]:
    """log p(tokens[i+1] | tokens[:i+1]) for every i, from one plain transformers + peft forward pass."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return logp_TV[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def mint(trace_id: str) -> str:
    """``fanroute credentials mint TRACE_ID`` (writes Redis directly), its stdout the token."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert relay_cli.run(argparse.Namespace(action="mint", trace_id=trace_id, ttl=600.0, base_url=None)) == 0
    return out.getvalue().strip()


async def completions_served(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fanroute_sampler_requests_total") and '"/v1/completions"' in line)


async def test_sdks_through_the_relay_on_the_real_stack(kafka_bootstrap, redis_url, tmp_path, monkeypatch):
    ns = f"relay{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    monkeypatch.setenv("FANROUTE_REDIS__URL", redis_url)
    monkeypatch.setenv("FANROUTE_KAFKA__TOPIC_NAMESPACE", ns)
    base = build_tiny_model(tmp_path / "base")
    lora = build_lora_adapter(base, tmp_path / "lora", seed=5)
    sport = free_port()
    s_settings = SamplerSettings(kafka=kafka, redis=redis, port=sport, base_model=str(base), served_model_name="base",
                                 consume_adapters=False, adapter_cache_dir=tmp_path / "cache")
    stamps = RedisStampStore(redis_url, ns)
    assert await stamps.incr("policy") == 1  # what the publisher does when it publishes policy@1
    await stamps.close()
    settings = RelaySettings(kafka=kafka, redis=redis, sampler_url=f"http://127.0.0.1:{sport}", tokenizer=str(base),
                             adapter_model_id="policy", admin_token=ADMIN)
    async with contextlib.AsyncExitStack() as stack:
        surl = await stack.enter_async_context(served(sampler_app(s_settings), sport, what="sampler",
                                                      start_timeout_s=120))
        sampler = await stack.enter_async_context(httpx.AsyncClient(base_url=surl, timeout=60))
        r = await sampler.post("/v1/load_lora_adapter", json={"lora_name": "policy@1", "lora_path": str(lora)})
        assert r.status_code == 200, r.text
        url, _ = await stack.enter_async_context(relay_served(settings))
        tokens = {t: await asyncio.to_thread(mint, t) for t in ("ep-oa", "ep-an")}

        # --- OpenAI: sync turn, streamed turn that extends it, then a retry that rewrites the history
        oa = openai.OpenAI(base_url=f"{url}/tr/ep-oa/v1", api_key=tokens["ep-oa"], max_retries=0)
        msgs = [{"role": "system", "content": "Route."}, {"role": "user", "content": "cells in the heart"}]
        first = await asyncio.to_thread(oa.chat.completions.create, model="policy", messages=msgs, max_tokens=5, seed=1)
        turn2 = [*msgs, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and why?"}]
        chunks = await asyncio.to_thread(lambda: list(oa.chat.completions.create(
            model="policy", messages=turn2, max_tokens=5, seed=2, stream=True)))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        retry = [*msgs, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "and why?"}]
        await asyncio.to_thread(oa.chat.completions.create, model="policy", messages=retry, max_tokens=5, seed=3)

        # --- Anthropic: sync turn, streamed turn that extends it
        an = anthropic.Anthropic(base_url=f"{url}/tr/ep-an", api_key=tokens["ep-an"], max_retries=0)
        amsgs = [{"role": "user", "content": "which provider for wings?"}]
        m1 = await asyncio.to_thread(an.messages.create, model="policy", max_tokens=5, system="Route.", messages=amsgs)

        def stream_turn() -> str:
            with an.messages.stream(model="policy", max_tokens=5, system="Route.", messages=[
                    *amsgs, {"role": "assistant", "content": m1.content}, {"role": "user", "content": "sure?"}]) as s:
                return "".join(s.text_stream)

        astreamed = await asyncio.to_thread(stream_turn)

        # --- refusals on the real stack never reach the real sampler
        before = await completions_served(sampler)
        async with httpx.AsyncClient(base_url=url) as raw:
            for headers, status in [({}, 401), ({"authorization": "Bearer frt_" + "B" * 43}, 401),
                                    ({"x-api-key": tokens["ep-an"]}, 403)]:
                r = await raw.post("/tr/ep-oa/v1/chat/completions", headers=headers,
                                   json={"model": "p", "messages": msgs})
                assert r.status_code == status and r.json()["reason"], r.text
        with pytest.raises(openai.AuthenticationError):
            await asyncio.to_thread(openai.OpenAI(base_url=f"{url}/tr/ep-oa/v1", api_key="sk-nope", max_retries=0)
                                    .chat.completions.create, model="p", messages=msgs)
        with pytest.raises(anthropic.PermissionDeniedError):
            await asyncio.to_thread(anthropic.Anthropic(base_url=f"{url}/tr/ep-oa", api_key=tokens["ep-an"],
                                                        max_retries=0).messages.create,
                                    model="p", max_tokens=3, messages=amsgs)
        assert await completions_served(sampler) == before

        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
            ends = {t: (await admin.post(f"/admin/v1/episodes/{t}/end", json={"advantage": 1.0})).json()
                    for t in tokens}

    async def on_topic() -> list[Call]:
        found = [c async for c in read_topic(kafka, topic("calls"), model=Call)]
        return found if len(found) == 5 else []

    calls = {c.call_id: c for c in await eventually(on_topic, timeout_s=60, what="5 calls on the calls topic")}
    oa_calls = [calls[f"ep-oa:{i}"] for i in range(3)]
    an_calls = [calls[f"ep-an:{i}"] for i in range(2)]
    assert [c.disposition for c in oa_calls] == ["new_segment:first", "extend", "new_segment:history_rewrite"]
    assert [c.disposition for c in an_calls] == ["new_segment:first", "extend"]
    assert oa_calls[1].text == streamed and an_calls[1].text == astreamed and oa_calls[1].stream
    assert {c.adapter for c in calls.values()} == {"policy@1"}
    assert oa_calls[0].request["messages"] == msgs and an_calls[0].request["system"] == "Route."
    for c in calls.values():  # each record against one forward pass over its own prompt + sampled ids
        lp = forward_logprobs(base, lora, [*c.prompt_ids, *c.sampled_ids])[len(c.prompt_ids) - 1:]
        assert len(lp) == len(c.sampled_logprobs) > 0
        assert max(abs(a - b) for a, b in zip(lp, c.sampled_logprobs)) < TOL, c.call_id

    assert ends["ep-oa"]["segments"] == 2 and ends["ep-an"]["segments"] == 1
    for trace, end in ends.items():
        for datum in end["datums"]:  # each datum against one forward pass over its whole token stream
            inputs = [t for ch in datum["model_input"]["chunks"] for t in ch["tokens"]]
            loss = datum["loss_fn_inputs"]
            tokens_T = [*inputs, loss["target_tokens"][-1]]
            lp = forward_logprobs(base, lora, tokens_T)
            on = [i for i, w in enumerate(loss["weights"]) if w == 1.0]
            assert on and max(abs(lp[i] - loss["logprobs"][i]) for i in on) < TOL, trace
            members = [calls[f"{trace}:{i}"] for i in datum["call_indices"]]
            assert [loss["target_tokens"][i] for i in on] == [t for c in members for t in c.sampled_ids]
            assert all(loss["advantages"][i] == 1.0 for i in on)
    assert [d["call_indices"] for d in ends["ep-oa"]["datums"]] == [[0, 1], [2]]
