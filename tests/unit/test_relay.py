"""The relay driven by the official OpenAI and Anthropic SDKs (sync and streaming, multi-turn) against the
real CPU sampler on a tiny model with a LoRA adapter: each call's record holds the exact ids the
sampler saw and sampled, with logprobs equal to a plain transformers + peft forward pass; a reply sent
back unchanged extends the episode, a rewritten history starts a new segment, housekeeping calls stay
out; the episode's end folds it into datums."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

from services.common.stamps import MemoryStampStore
from tests.support.relay import cpu_sampler, relay_served, relay_settings, teacher_forced
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

ADMIN = "admin-token-relay-tests"
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("relay-sdk")
    base = build_tiny_model(root / "base")
    return {"base": base, "lora": build_lora_adapter(base, root / "lora", seed=3)}


@pytest.fixture
async def stack(tiny, tmp_path):
    """(relay URL, Relay, token for trace ep-1): the policy is adapter ``policy@1`` (its stamp is 1)."""
    stamps = MemoryStampStore()
    stamps.stamps["policy"] = 1
    settings = relay_settings(tiny["base"], adapter_model_id="policy", admin_token=ADMIN,
                              housekeeping_rules=(r"^Generate a title",))
    async with cpu_sampler(tiny["base"], tmp_path, {"policy@1": tiny["lora"]}) as sampler:
        async with relay_served(settings, sampler, stamps=stamps) as (url, relay):
            yield url, relay, await relay.credentials.mint("ep-1", 600)


def check_against_forward_pass(tiny, calls) -> None:
    for c in calls:
        expected = teacher_forced(tiny["base"], tiny["lora"], list(c.prompt_ids), list(c.sampled_ids))
        assert len(expected) == len(c.sampled_logprobs) > 0
        assert max(abs(a - b) for a, b in zip(expected, c.sampled_logprobs)) < TOL, c.call_index


def extends(later, earlier) -> bool:
    before = [*earlier.prompt_ids, *earlier.sampled_ids]
    return list(later.prompt_ids[:len(before)]) == before


async def test_openai_sdk_sync_and_streaming_multi_turn(tiny, stack):
    url, relay, token = stack
    client = openai.OpenAI(base_url=f"{url}/tr/ep-1/v1", api_key=token, max_retries=0)
    msgs = [{"role": "system", "content": "You route queries."}, {"role": "user", "content": "cells in a mouse heart"}]
    first = await asyncio.to_thread(client.chat.completions.create, model="policy", messages=msgs, max_tokens=6,
                                    temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
    reply = first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length") and first.model == "policy"
    assert first.usage.completion_tokens == len(first.choices[0].logprobs.content) > 0
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and the wing?"}]

    def stream() -> tuple[str, list]:
        parts, chunks = [], client.chat.completions.create(model="policy", messages=msgs, max_tokens=6, seed=8,
                                                           stream=True, stream_options={"include_usage": True})
        events = list(chunks)
        parts = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
        return "".join(parts), events

    streamed, events = await asyncio.to_thread(stream)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens > 0
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] in ("stop", "length")
    calls = await relay.state.calls("ep-1")
    assert [c.disposition for c in calls] == ["new_segment:first", "extend"]
    assert calls[1].spliced_from == 0 and extends(calls[1], calls[0])
    assert calls[0].text == reply and calls[1].text == streamed and calls[1].stream
    assert {c.adapter for c in calls} == {"policy@1"} and calls[0].sampler_model == "policy@1"
    assert calls[0].request["messages"][1]["content"] == "cells in a mouse heart"  # the request as received
    assert [c.wire for c in calls] == ["openai", "openai"]
    check_against_forward_pass(tiny, calls)


async def test_anthropic_sdk_sync_and_streaming_multi_turn(tiny, stack):
    url, relay, token = stack
    client = anthropic.Anthropic(base_url=f"{url}/tr/ep-1", api_key=token, max_retries=0)
    msgs = [{"role": "user", "content": "which provider for proteins?"}]
    first = await asyncio.to_thread(client.messages.create, model="policy", max_tokens=6, system="Route.",
                                    messages=msgs, extra_body={"seed": 3, "temperature": 0.9})
    assert first.type == "message" and first.stop_reason in ("end_turn", "max_tokens")
    msgs += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "why?"}]

    def stream():
        with client.messages.stream(model="policy", max_tokens=6, system="Route.", messages=msgs) as s:
            text = "".join(s.text_stream)
            return text, s.get_final_message()

    text, final = await asyncio.to_thread(stream)
    assert final.content[0].text == text and final.usage.output_tokens > 0
    calls = await relay.state.calls("ep-1")
    assert [c.disposition for c in calls] == ["new_segment:first", "extend"] and extends(calls[1], calls[0])
    assert calls[0].text == first.content[0].text and calls[1].text == text
    assert [c.wire for c in calls] == ["anthropic", "anthropic"]
    check_against_forward_pass(tiny, calls)


async def test_stop_sequences_cut_the_reply_but_the_sampled_ids_stay(tiny, stack):
    url, relay, token = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-1/v1", api_key=token, max_retries=0)
    msgs = [{"role": "user", "content": "hello world"}]
    greedy = await client.chat.completions.create(model="p", messages=msgs, max_tokens=10, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    cut = await client.chat.completions.create(model="p", messages=msgs, max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]
    ac = anthropic.AsyncAnthropic(base_url=f"{url}/tr/ep-1", api_key=token, max_retries=0)
    m = await ac.messages.create(model="p", max_tokens=10, messages=msgs, stop_sequences=[stop],
                                 extra_body={"temperature": 0})  # newer SDKs dropped the sampling arguments
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    calls = await relay.state.calls("ep-1")
    assert stop in relay.renderer.decode(calls[1].sampled_ids)  # the stop string's tokens were sampled and kept
    # the harness sends the cut reply back: the prompt keeps the sampled ids, stop string and all
    nxt = await client.chat.completions.create(model="p", max_tokens=3, messages=[
        *msgs, {"role": "assistant", "content": cut.choices[0].message.content}, {"role": "user", "content": "go"}])
    assert nxt.choices[0].message.content is not None
    last = (await relay.state.calls("ep-1"))[-1]
    # calls 1 and 2 (OpenAI, then Anthropic) had the same conversation and reply: the latest is spliced in
    assert last.spliced_from == 2 and extends(last, calls[2]) and last.disposition == "extend"


async def test_history_rewrite_and_housekeeping_fold_into_two_segments(tiny, stack):
    url, relay, token = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-1/v1", api_key=token, max_retries=0)
    msgs = [{"role": "user", "content": "query one"}]
    a = await client.chat.completions.create(model="p", messages=msgs, max_tokens=4, seed=1)
    title = await client.chat.completions.create(model="p", max_tokens=3, messages=[
        {"role": "user", "content": "Generate a title for this chat"}])
    header = await client.chat.completions.create(model="p", max_tokens=3, messages=msgs,
                                                  extra_headers={"X-Fanroute-Housekeeping": "1"})
    assert title.choices[0].message.content is not None and header.choices[0].message.content is not None
    turn2 = [*msgs, {"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "more"}]
    await client.chat.completions.create(model="p", messages=turn2, max_tokens=4, seed=2)
    retry = [*msgs, {"role": "assistant", "content": "a rewritten reply"}, {"role": "user", "content": "more"}]
    await client.chat.completions.create(model="p", messages=retry, max_tokens=4, seed=3)
    calls = await relay.state.calls("ep-1")
    assert [c.disposition for c in calls] == ["new_segment:first", "housekeeping", "housekeeping", "extend",
                                              "new_segment:history_rewrite"]
    assert calls[1].housekeeping_reason == "rule:^Generate a title" and calls[2].housekeeping_reason == "header"
    async with httpx.AsyncClient(base_url=url) as admin:
        r = await admin.post("/admin/v1/episodes/ep-1/end", json={"advantage": 0.5},
                             headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["segments"] == 2 and body["calls"] == 5 and body["dispositions"]["housekeeping"] == 2
    d1, d2 = body["datums"]
    assert d1["call_indices"] == [0, 3] and d2["call_indices"] == [4]
    for datum, members in ((d1, [calls[0], calls[3]]), (d2, [calls[4]])):
        inputs = [t for ch in datum["model_input"]["chunks"] for t in ch["tokens"]]
        tokens = [*inputs, datum["loss_fn_inputs"]["target_tokens"][-1]]
        last = members[-1]
        assert tokens == [*last.prompt_ids, *last.sampled_ids]  # the segment is the last call's whole stream
        w, lp = datum["loss_fn_inputs"]["weights"], datum["loss_fn_inputs"]["logprobs"]
        sampled = [t for t, x in zip(datum["loss_fn_inputs"]["target_tokens"], w) if x == 1.0]
        assert sampled == [t for c in members for t in c.sampled_ids]
        assert [x for x, k in zip(lp, w) if k] == pytest.approx([x for c in members for x in c.sampled_logprobs])
        assert set(a for a, k in zip(datum["loss_fn_inputs"]["advantages"], w) if k) == {0.5}


async def test_models_lists_the_policy_for_both_sdks(stack):
    url, _, token = stack
    listed = await openai.AsyncOpenAI(base_url=f"{url}/tr/ep-1/v1", api_key=token).models.list()
    assert [m.id for m in listed.data] == ["policy@1"]
    page = await anthropic.AsyncAnthropic(base_url=f"{url}/tr/ep-1", api_key=token).models.list()
    assert [m.id for m in page.data] == ["policy@1"]
