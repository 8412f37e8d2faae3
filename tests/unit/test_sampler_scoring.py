"""Scoring in the CPU sampler: vLLM's ``prompt_logprobs`` on /v1/completions, equal to a plain forward pass.

Every check compares the returned prompt logprobs (and the first generated token) with an independent
transformers (+ peft) model's ``model(input_ids).logits.log_softmax(-1)`` over each whole prompt: for
the base and an adapter, one prompt and several, with and without a prefix-cache hit, packed into
several rows or forwards, and two concurrent requests scored in one batch.
"""

from __future__ import annotations

import asyncio

import pytest

from services.sampler.engine import Engine
from services.sampler.scoring import PrefixCache, Scorer
from tests.support.scoring import (  # noqa: F401 - tiny and harness are fixtures
    BASE,
    NAMES,
    TOL,
    assert_prompt_logprobs_match,
    harness,
    reference_rows,
    tiny,
)


# ------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("k", [0, 3])
async def test_one_prompt_matches_a_plain_forward_pass(harness, tiny, k):
    body = await harness.score("which search provider should answer this query about cells", k=k)
    choice = body["choices"][0]
    assert_prompt_logprobs_match(harness, None, choice, k)
    rows = reference_rows(tiny, None, choice["prompt_token_ids"])
    assert choice["token_ids"] == [int(rows[-1].argmax())]  # greedy, from the scoring pass's last row
    assert choice["text"] == harness.sampler.eng.decode(choice["token_ids"])
    assert choice["finish_reason"] in ("length", "stop") and body["object"] == "text_completion"
    n = len(choice["prompt_token_ids"])
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}


async def test_router_candidates_base_then_adapter_with_cache_hits(harness, tiny):
    """K candidates of one prompt, twice (the second hits the cache), for the base and for an adapter:
    the cache is per adapter, so the adapter's numbers are its own."""
    assert (await harness.client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "lora-a", "lora_path": str(tiny["a"])})).status_code == 200
    for model, adapter in ((BASE, None), ("lora-a", "a")):
        for query in ("what is a cell?", "what is a wing?"):
            body = await harness.score(harness.router_prompts(query), k=2, model=model)
            assert [c["index"] for c in body["choices"]] == list(range(len(NAMES)))
            for choice in body["choices"]:
                assert_prompt_logprobs_match(harness, adapter, choice, 2)
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="miss") == 2  # once per adapter
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="partial") \
        + harness.metric("fanroute_sampler_score_forwards_total", cache="hit") == 2
    assert harness.metric("fanroute_sampler_tokens_total", kind="prompt_reused") > 0
    base_again = await harness.score(harness.router_prompts("what is a cell?"), k=2)
    for choice in base_again["choices"]:
        assert_prompt_logprobs_match(harness, None, choice, 2)


async def test_token_id_prompts_edge_shapes_and_a_repeat_hit(harness, tiny):
    """Token ids; a prompt that is a prefix of another, a duplicate, a one-token prompt; then a full hit."""
    eng = harness.sampler.eng
    long = eng.encode("You route search queries to search providers. The providers are: bio-dense")
    prompts = [long, long[:-3], long, long[:1], long[:20] + [5, 6, 7]]
    for _ in range(2):
        body = await harness.score(prompts, k=1)
        for ids, choice in zip(prompts, body["choices"]):
            assert choice["prompt_token_ids"] == ids
            if len(ids) == 1:
                assert choice["prompt_logprobs"] == [None]
            else:
                assert_prompt_logprobs_match(harness, None, choice, 1)
    for _ in range(2):  # alone: cached the first time, a whole-entry hit the second
        one = await harness.score(long, k=0)
        assert_prompt_logprobs_match(harness, None, one["choices"][0], 0)
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="hit") == 1


@pytest.mark.parametrize("harness", [{"score_row_tokens": 8, "score_max_forward_tokens": 40,
                                      "prefix_cache_min_tokens": 4}], indirect=True)
async def test_many_rows_and_forwards_still_match(harness, tiny):
    prompts = harness.router_prompts("what is a cell?")[:3] + harness.router_prompts("a supersonic wing")[:3]
    body = await harness.score(prompts, k=2)
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, None, choice, 2)
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="miss") \
        + harness.metric("fanroute_sampler_score_forwards_total", cache="partial") \
        + harness.metric("fanroute_sampler_score_forwards_total", cache="hit") > 1


@pytest.mark.parametrize("harness", [{"prefix_cache_entries": 0}], indirect=True)
async def test_no_cache_still_matches(harness, tiny):
    for _ in range(2):
        for choice in (await harness.score(harness.router_prompts("what is a cell?")[:2], k=1))["choices"]:
            assert_prompt_logprobs_match(harness, None, choice, 1)
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="miss") == 2
    assert len(harness.sampler.eng.prefix_cache) == 0


@pytest.mark.parametrize("harness", [{"score_batch_wait_ms": 50}], indirect=True)
async def test_two_concurrent_requests_are_scored_in_one_batch(harness, tiny):
    a, b = await asyncio.gather(harness.score(harness.router_prompts("what is a cell?"), k=1),
                                harness.score(harness.router_prompts("heat transfer in a wing"), k=1))
    assert harness.metric("fanroute_sampler_score_batch_requests_count") == 1
    assert harness.metric("fanroute_sampler_score_batch_requests_sum") == 2
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="miss") == 1  # one forward for both
    assert harness.metric("fanroute_sampler_score_batch_wait_seconds_count") == 1
    assert 0.04 <= harness.metric("fanroute_sampler_score_batch_wait_seconds_sum") < 5  # ≈ score_batch_wait_ms
    for choice in a["choices"] + b["choices"]:
        assert_prompt_logprobs_match(harness, None, choice, 1)


async def test_longer_generations_and_sampling_stay_as_without_prompt_logprobs(harness, tiny):
    ask = {"max_tokens": 6, "temperature": 1.0, "seed": 4, "ignore_eos": True, "logprobs": 1,
           "return_token_ids": True}
    plain = (await harness.client.post("/v1/completions", json={"prompt": "hello world", **ask})).json()
    scored = await harness.score("hello world", k=0, **ask)
    assert scored["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert scored["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
    assert plain["choices"][0]["prompt_logprobs"] is None and scored["choices"][0]["prompt_logprobs"][0] is None
    one = {**ask, "max_tokens": 1}
    first = (await harness.client.post("/v1/completions", json={"prompt": "hello world", **one})).json()
    again = await harness.score("hello world", k=0, **one)  # drawn from the scoring row, same seed
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def test_unloading_an_adapter_drops_its_cached_prefixes(harness, tiny):
    await harness.client.post("/v1/load_lora_adapter", json={"lora_name": "lora-a", "lora_path": str(tiny["a"])})
    await harness.score(harness.router_prompts("what is a cell?"), model="lora-a")
    await harness.score(harness.router_prompts("what is a cell?"))
    cache = harness.sampler.eng.prefix_cache
    slot = harness.sampler.registry.get("lora-a").slot
    assert {key[0] for key in cache._entries} == {slot, None}
    await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"})
    assert {key[0] for key in cache._entries} == {None}


async def test_the_gateways_scoring_request_reads_back_from_the_sampler(harness):
    """services.router.scoring's request (ChatML prompts + names) and parser against this server."""
    from services.router.scoring import parse_scores, score_request

    body = score_request(BASE, NAMES, "what is a cell?")
    r = await harness.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    scores = parse_scores(r.json(), NAMES)
    assert set(scores) == set(NAMES) and all(v < 0 for v in scores.values())
    for choice in r.json()["choices"]:
        assert all(len(entry) == 1 for entry in choice["prompt_logprobs"][1:])  # prompt_logprobs=0


# ------------------------------------------------------------------------------ bad requests
BAD = [
    {"prompt": "x", "prompt_logprobs": -1},
    {"prompt": "x", "prompt_logprobs": -7},
    {"prompt": "x", "prompt_logprobs": 21},  # over max_logprobs (20)
    {"prompt": "x", "prompt_logprobs": "2"},
    {"prompt": "x", "prompt_logprobs": 1.5},
    {"prompt": "x", "prompt_logprobs": 0, "echo": True},
    {"prompt": "x", "prompt_logprobs": 0, "stream": True},
    {"prompt": "x", "prompt_logprobs": 0, "max_tokens": 0},
]


@pytest.mark.parametrize("body", BAD, ids=[str(b)[:60] for b in BAD])
async def test_bad_prompt_logprobs_are_400_with_error_and_reason(harness, body):
    r = await harness.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert isinstance(err["error"], str) and isinstance(err["reason"], str) and err["reason"]
    assert err["object"] == "error" and err["code"] == 400 and err["message"] == err["reason"]


@pytest.mark.parametrize("harness", [{"max_logprobs": 2}], indirect=True)
async def test_prompt_logprobs_are_bounded_by_max_logprobs(harness):
    r = await harness.client.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 3})
    assert r.status_code == 400 and r.json()["param"] == "prompt_logprobs" and "2" in r.json()["reason"]
    assert (await harness.score("hello", k=2))["choices"][0]["prompt_logprobs"][1]


# ------------------------------------------------------------------------------ the cache itself
def test_prefix_cache_is_lru_per_slot_and_skips_short_prefixes(tiny):
    engine = Engine(tiny["base"])
    cache = PrefixCache(capacity=2, min_tokens=4)
    scorer = Scorer(engine, cache, top_k_cached=2)
    ids = engine.encode("You route search queries to search providers. The providers are: bio-dense, bm25-all")
    assert len(ids) > 16
    scorer.score([ids[:3]], [0], None)
    assert len(cache) == 0  # shorter than min_tokens
    for n in (10, 12, 14):
        scorer.score([ids[:n] + [7, 8]], [0], None)
    assert len(cache) == 2 and cache.capacity == 2
    entry, shared = cache.lookup(None, ids[:14] + [9])
    assert shared == 14 and entry is not None and len(entry.stats) == len(entry.tokens) - 1
    assert cache.lookup("lora1", ids)[0] is None
    cache.drop(None)
    assert len(cache) == 0


def test_packing_keeps_a_querys_candidates_in_one_row_and_the_shared_tokens_first():
    from services.sampler.scoring import _pack

    shared, q1, q2 = [1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]
    prompts = [shared + q1 + [c] for c in (30, 31, 32)] + [shared + q2 + [c] for c in (30, 31, 32)]
    rows, paths = _pack(prompts, 1, row_tokens=8)
    assert [len(r.tokens) for r in rows] == [9, 9]  # 2 shared + 4 query + 3 candidates, twice
    assert paths[0][:2] == [0, 1] and all(p[:6] == paths[0][:6] for p in paths[:3])
    assert all(p[0] == 9 for p in paths[3:])  # the second row's flat ids follow the first's
    assert [rows[1].position[i - 9] for i in paths[4]] == list(range(1, 8))
    one, _ = _pack(prompts, 1, row_tokens=64)
    assert len(one) == 1 and len(one[0].tokens) == 2 + 4 + 3 + 4 + 3


def test_each_forwards_key_length_is_padded_to_the_alignment_and_the_numbers_do_not_move(tiny):
    """Cached prefix + row width is a multiple of ``KV_ALIGN`` (CPU attention is ~2x slower off it);
    nothing attends to the padding, so every prompt's logprobs still equal a plain forward's."""
    from services.sampler.scoring import KV_ALIGN

    engine = Engine(tiny["base"])
    scorer = Scorer(engine, PrefixCache(capacity=4, min_tokens=4), top_k_cached=2)
    keys: list[int] = []
    forward = scorer._forward

    def spy(decoder, rows, prefix, m):
        hidden, kv = forward(decoder, rows, prefix, m)
        keys.append(kv[0][0].shape[2])
        assert hidden.shape[0] == sum(len(r.tokens) for r in rows)  # no padding in what is read back
        return hidden, kv

    scorer._forward = spy
    ids = engine.encode("You route search queries to search providers. The providers are: bio-dense, bm25-all")
    prompts = [ids + engine.encode(q) for q in (" what is a cell", " wing flutter at mach two", " a")]
    for batch in ([ids[:13]], prompts, prompts[1:]):  # a miss of 13 tokens, then cache hits after 13+
        scored, _info = scorer.score(batch, [2] * len(batch), None)
        for p, got in zip(batch, scored):
            ref = reference_rows(tiny, None, p)
            for pos in range(1, len(p)):
                assert abs(got.prompt_logprobs[pos][0][1] - float(ref[pos - 1, p[pos]])) < TOL
    assert len(keys) == 3 and all(k % KV_ALIGN == 0 for k in keys), keys
    assert keys[0] == KV_ALIGN  # 13 tokens, no prefix: padded to 16


# ------------------------------------------------------------------------------ lean prompts
def test_a_lean_prompt_gets_the_last_row_and_skips_the_output_layer_elsewhere(tiny):
    """``k`` None (a one-token completion without prompt_logprobs): the row after the prompt equals a plain
    forward's, the output layer runs on that row alone, and what it cached serves lean prompts only."""
    import torch

    engine = Engine(tiny["base"])
    cache = PrefixCache(capacity=4, min_tokens=4)
    scorer = Scorer(engine, cache, top_k_cached=2)
    head = engine.model.get_output_embeddings()
    rows_seen: list[int] = []
    hook = head.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))
    ids = engine.encode("You route search queries to search providers. The providers are: bio-dense, bm25-all")
    try:
        [lean], info = scorer.score([ids], [None], None)
    finally:
        hook.remove()
    assert rows_seen == [1] and info.forwarded_tokens == len(ids)  # one output row for the whole prompt
    assert lean.prompt_logprobs == []
    assert torch.allclose(lean.row, reference_rows(tiny, None, ids)[-1], atol=TOL)
    entry, shared = cache.lookup(None, ids, stats=False)
    assert shared == len(ids) and entry is not None and entry.stats is None  # keys/values, no statistics
    assert cache.lookup(None, ids)[0] is None  # a prompt that wants logprobs passes over it
    # another query after the same system prompt: a lean prompt reuses the cached keys/values ...
    other = ids[:-3] + engine.encode(" lib-bm25")[-2:]
    [again], info = scorer.score([other], [None], None)
    assert info.cache == ["partial"] and info.reused_tokens > 0
    assert torch.allclose(again.row, reference_rows(tiny, None, other)[-1], atol=TOL)
    # ... and a prompt that wants its logprobs forwards it all, numbers exact, mixed with a lean one
    [full, lean2], info = scorer.score([other, ids], [1, None], None)
    assert info.cache == ["miss"] and len(full.prompt_logprobs) == len(other) and lean2.prompt_logprobs == []
    ref = reference_rows(tiny, None, other)
    for pos in range(1, len(other)):
        assert abs(full.prompt_logprobs[pos][0][1] - float(ref[pos - 1, other[pos]])) < TOL
    assert torch.allclose(lean2.row, reference_rows(tiny, None, ids)[-1], atol=TOL)


async def test_a_one_token_completion_without_prompt_logprobs_is_scored_lean(harness, tiny):
    """The router's first-token request over HTTP: the same token and top alternatives as a plain forward."""
    prompt = harness.router_prompts("what is a cell?")[0]
    for _ in range(2):
        r = await harness.client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 3, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        row = reference_rows(tiny, None, choice["prompt_token_ids"])[-1]
        assert choice["token_ids"] == [int(row.argmax())] and choice["prompt_logprobs"] is None
        assert abs(choice["logprobs"]["token_logprobs"][0] - float(row.max())) < TOL
    assert harness.metric("fanroute_sampler_score_forwards_total", cache="partial") \
        + harness.metric("fanroute_sampler_score_forwards_total", cache="hit") >= 1  # the second reused the first


async def test_an_adapter_trained_on_another_base_is_refused_over_http_and_the_loaded_ones_still_serve(
        harness, tiny, tmp_path):
    """``/v1/load_lora_adapter`` with an adapter of a deeper base (the same sizes, one layer more): a 400
    naming the mismatch (peft itself would have loaded it, dropping the extra layer's weights)."""
    from tests.support.tiny_model import build_lora_adapter, build_tiny_model

    deeper = build_tiny_model(tmp_path / "deeper", context=128, layers=3)
    r = await harness.client.post("/v1/load_lora_adapter", json={"lora_name": "deeper", "lora_path": str(
        build_lora_adapter(deeper, tmp_path / "deeper-lora", seed=1))})
    assert r.status_code == 400 and "does not fit this base model" in r.json()["message"], r.text
    assert "model.layers.2." in r.json()["message"] and r.json()["param"] == "lora_path"
    assert (await harness.client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "lora-a", "lora_path": str(tiny["a"])})).status_code == 200
    body = await harness.score(harness.router_prompts("what is a cell?"), k=2, model="lora-a")
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, "a", choice, 2)
