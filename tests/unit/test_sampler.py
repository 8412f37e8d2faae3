"""The CPU sampler on a tiny random Llama: vLLM's shapes, exact token ids + logprobs, LoRA slots, bad
requests (pulls and announcements: test_sampler_adapters.py)."""

from __future__ import annotations

import httpx
import pytest

from services.sampler.app import create_app
from services.sampler.engine import Engine
from services.sampler.serving import Sampler
from tests.support.sampler_harness import (  # noqa: F401  (fixtures by name)
    BASE, PROMPT, TOL, assert_matches_forward_pass, harness, make_settings, teacher_forced, tiny)


# ------------------------------------------------------------------------------ completions
async def test_completion_ids_and_logprobs_match_a_direct_forward_pass(harness, tiny):
    body = await harness.complete(model=BASE, max_tokens=8, temperature=1.0, seed=3, logprobs=2,
                                  return_token_ids=True, ignore_eos=True)
    assert body["object"] == "text_completion" and body["model"] == BASE and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == harness.sampler.eng.encode(PROMPT)
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert_matches_forward_pass(tiny, None, choice)
    assert choice["text"] == harness.sampler.eng.decode(choice["token_ids"])
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(2 <= len(step) <= 3 for step in lp["top_logprobs"])  # sampled + top-2 (deduplicated)
    assert lp["top_logprobs"][0][lp["tokens"][0]] == pytest.approx(lp["token_logprobs"][0])
    assert body["usage"] == {"prompt_tokens": len(choice["prompt_token_ids"]), "completion_tokens": 8,
                             "total_tokens": len(choice["prompt_token_ids"]) + 8}


async def test_token_id_prompt_and_greedy_follow_the_argmax(harness, tiny):
    ids = harness.sampler.eng.encode(PROMPT)
    by_text = await harness.complete(max_tokens=6, temperature=0, return_token_ids=True, logprobs=0)
    by_ids = await harness.complete(prompt=ids, max_tokens=6, temperature=0, return_token_ids=True, logprobs=0)
    a, b = by_text["choices"][0], by_ids["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["prompt_token_ids"] == b["prompt_token_ids"] == ids
    _, argmax = teacher_forced(tiny, None, ids, a["token_ids"])
    assert a["token_ids"] == argmax
    assert all(len(step) == 1 for step in a["logprobs"]["top_logprobs"])  # logprobs=0: the sampled one only
    assert "token_ids" in a and (await harness.complete(max_tokens=2))["choices"][0]["token_ids"] is None


async def test_same_seed_same_tokens_other_seed_other_tokens(harness):
    async def ids(seed):
        body = await harness.complete(max_tokens=12, temperature=1.0, seed=seed, return_token_ids=True,
                                      ignore_eos=True)
        return body["choices"][0]["token_ids"]

    first = await ids(11)
    assert await ids(11) == first
    assert any([await ids(s) != first for s in (12, 13, 14)])


async def test_stop_string_cuts_the_text_and_is_reported(harness):
    full = (await harness.complete(max_tokens=16, temperature=0, ignore_eos=True))["choices"][0]["text"]
    at = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].strip() == full[i:i + 2])
    stop = full[at:at + 2]
    choice = (await harness.complete(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "§never§"],
                                     return_token_ids=True))["choices"][0]
    assert choice["text"] == full[:full.find(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert len(choice["token_ids"]) < 16


async def test_batched_prompts_answer_one_choice_each(harness):
    body = await harness.complete(prompt=["hello", "world"], max_tokens=3, temperature=0)
    assert [c["index"] for c in body["choices"]] == [0, 1]


# ------------------------------------------------------------------------------ chat
async def test_chat_completion_renders_the_template_and_reports_logprobs(harness, tiny):
    messages = [{"role": "system", "content": "route"}, {"role": "user", "content": "what is a cell?"}]
    r = await harness.client.post("/v1/chat/completions", json={
        "model": BASE, "messages": messages, "max_tokens": 6, "temperature": 0.7, "seed": 5,
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tok = harness.sampler.eng.tokenizer
    expected_prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)
    assert body["object"] == "chat.completion" and body["prompt_token_ids"] == expected_prompt
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == harness.sampler.eng.decode(choice["token_ids"])
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [harness.sampler.eng.token_text(t) for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    expected, _ = teacher_forced(tiny, None, expected_prompt, choice["token_ids"])
    assert max(abs(c["logprob"] - e) for c, e in zip(content, expected)) < TOL


# ------------------------------------------------------------------------------ adapters
async def test_two_adapters_at_once_differ_and_each_matches_its_forward_pass(harness, tiny):
    assert (await harness.load("lora-a", tiny["a"])).text == "Success: LoRA adapter 'lora-a' added successfully."
    assert (await harness.load("lora-b", tiny["b"])).status_code == 200
    assert harness.sampler.registry.resident() == ["lora-a", "lora-b"]
    outs = {}
    for model, adapter in (("lora-a", "a"), ("lora-b", "b"), (BASE, None), ("lora-a", "a")):
        body = await harness.complete(model=model, max_tokens=6, temperature=1.0, seed=9, logprobs=1,
                                      return_token_ids=True, ignore_eos=True)
        assert body["model"] == model
        choice = body["choices"][0]
        assert_matches_forward_pass(tiny, adapter, choice)
        outs.setdefault(model, []).append(choice["logprobs"]["token_logprobs"])
    assert outs["lora-a"][0] == outs["lora-a"][1]  # switching slots back and forth changes nothing
    assert len({tuple(v[0]) for v in outs.values()}) == 3
    models = (await harness.client.get("/v1/models")).json()
    cards = {c["id"]: c for c in models["data"]}
    assert models["object"] == "list" and cards[BASE]["parent"] is None
    assert cards["lora-a"]["parent"] == BASE and cards["lora-a"]["root"] == str(tiny["a"])


@pytest.mark.parametrize("harness", [{"max_resident_adapters": 1}], indirect=True)
async def test_lru_evicts_and_reloads_on_demand(harness, tiny):
    ask = dict(max_tokens=5, temperature=0, logprobs=0, return_token_ids=True, ignore_eos=True)
    await harness.load("lora-a", tiny["a"])
    first = (await harness.complete(model="lora-a", **ask))["choices"][0]
    await harness.load("lora-b", tiny["b"])
    assert harness.sampler.registry.resident() == ["lora-b"]
    assert harness.sampler.eng.slots == [harness.sampler.registry.get("lora-b").slot]
    again = (await harness.complete(model="lora-a", **ask))["choices"][0]  # reloaded from its dir
    assert harness.sampler.registry.resident() == ["lora-a"]
    assert again["token_ids"] == first["token_ids"]
    assert_matches_forward_pass(tiny, "a", again)
    assert {c["id"] for c in (await harness.client.get("/v1/models")).json()["data"]} == {BASE, "lora-a", "lora-b"}


async def test_load_and_unload_endpoints(harness, tiny):
    assert (await harness.load("lora-a", tiny["a"])).status_code == 200
    dup = await harness.load("lora-a", tiny["b"])
    assert dup.status_code == 400 and "already been loaded" in dup.json()["reason"]
    inplace = await harness.client.post("/v1/load_lora_adapter", json={
        "lora_name": "lora-a", "lora_path": str(tiny["b"]), "load_inplace": True})
    assert inplace.status_code == 200 and harness.sampler.registry.get("lora-a").path == tiny["b"]
    assert len(harness.sampler.eng.slots) == 1
    r = await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'lora-a' removed successfully."
    assert harness.sampler.eng.slots == [] and harness.sampler.registry.resident() == []
    again = await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"})
    assert again.status_code == 404 and again.json()["error"] == "adapter_not_found"
    gone = await harness.client.post("/v1/completions", json={"model": "lora-a", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404




# ------------------------------------------------------------------------------ bad requests
LONG = "which search provider " * 40
BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": 123}, 400),
    ("/v1/completions", {"prompt": ["a", 1]}, 400),
    ("/v1/completions", {"prompt": [1, "a"]}, 400),
    ("/v1/completions", {"prompt": [999999]}, 400),
    ("/v1/completions", {"prompt": [-1]}, 400),
    ("/v1/completions", {"prompt": [[]]}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 128}, 400),  # 1 + 128 tokens > the context (128)
    ("/v1/completions", {"prompt": LONG}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 100}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400),
    ("/v1/completions", {}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/tmp"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "BASE_DIR"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "ADAPTER_DIR"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 7}, 400),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404),
    ("/v1/unload_lora_adapter", {}, 400),
    ("/v1/no_such_route", {}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD, ids=[f"{p}:{b}"[:60] for p, b, _ in BAD])
async def test_bad_requests_are_4xx_with_error_and_reason(harness, tiny, path, body, status):
    body = {k: {"BASE_DIR": str(tiny["base"]), "ADAPTER_DIR": str(tiny["a"])}.get(v, v)
            if isinstance(v, str) else v for k, v in body.items()}
    r = await harness.client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and isinstance(err["reason"], str) and err["reason"]
    assert err["object"] == "error" and err["code"] == status and err["message"] == err["reason"]
    assert harness.sampler.eng.slots == []


async def test_not_json_and_wrong_method(harness):
    r = await harness.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json" and r.json()["object"] == "error"
    r = await harness.client.get("/v1/completions")
    assert r.status_code == 405 and "reason" in r.json() and r.headers["allow"] == "POST"


async def test_health_and_metrics(harness):
    assert (await harness.client.get("/health")).status_code == 200
    assert (await harness.client.get("/healthz")).json()["model"] == BASE
    await harness.complete(max_tokens=2)
    text = (await harness.client.get("/metrics")).text
    assert 'fanroute_sampler_requests_total{endpoint="/v1/completions",outcome="200"} 1.0' in text


async def test_body_over_the_limit_is_413(tiny, tmp_path):
    settings = make_settings(tmp_path, max_body_bytes=1024)
    sampler = Sampler(settings, engine=Engine(tiny["base"]))
    await sampler.start()
    app = create_app(settings, sampler=sampler)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large" and r.json()["reason"]
    # the same body as the sampler's other errors: vLLM's flat fields too
    assert r.json()["message"] == r.json()["reason"] and r.json()["type"] == "RequestEntityTooLargeError"


async def test_a_subnormal_temperature_is_greedy_not_a_500(harness):
    """1.4e-45 overflows logits / temperature to inf (softmax NaN): vLLM treats under 1e-5 as greedy, so do we."""
    greedy = await harness.complete(max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    tiny_t = await harness.complete(max_tokens=6, temperature=1.401298464324817e-45, ignore_eos=True,
                                   return_token_ids=True)
    ids = greedy["choices"][0]["token_ids"]
    assert tiny_t["choices"][0]["token_ids"] == ids and len(ids) == 6
