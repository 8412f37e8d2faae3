"""The CPU sampler on a tiny random Llama: vLLM's shapes, exact token ids + logprobs, LoRA slots, pulls."""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from schemas.adapter import AdapterPublished
from schemas.topics import topic
from services.common.settings import KafkaSettings
from services.sampler.app import create_app
from services.sampler.engine import Engine
from services.sampler.registry import AdapterUnavailable
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from tests.support.poll import eventually
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

TOL = 1e-4
BASE = "tiny-base"
PROMPT = "which search provider should answer"


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny base model and two LoRA adapters (different seeds, different target modules)."""
    root = tmp_path_factory.mktemp("tiny-lm")
    base = build_tiny_model(root / "base", context=128)
    return {"base": base,
            "a": build_lora_adapter(base, root / "lora-a", seed=1),
            "b": build_lora_adapter(base, root / "lora-b", seed=2, targets=("k_proj", "gate_proj"))}


_REFERENCE: dict[str, object] = {}


def reference_model(tiny: dict[str, Path], adapter: str | None):
    """An independent transformers (+ peft) model of base + ``adapter``, for teacher-forced checks."""
    key = adapter or "base"
    if key not in _REFERENCE:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny["base"], dtype=torch.float32).eval()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(tiny[adapter])).eval()
        _REFERENCE[key] = model
    return _REFERENCE[key]


def teacher_forced(tiny: dict[str, Path], adapter: str | None, prompt_ids: list[int], token_ids: list[int]):
    """Log-softmax of one forward pass over prompt + tokens, at each sampled token: (logprobs, argmaxes)."""
    import torch

    model = reference_model(tiny, adapter)
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt_ids + token_ids])).logits[0].float()
    logprobs_TV = torch.log_softmax(logits_TV[len(prompt_ids) - 1:-1], dim=-1)
    picked_T = logprobs_TV.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    return picked_T.tolist(), logprobs_TV.argmax(dim=-1).tolist()


def make_settings(tmp_path: Path, **kw) -> SamplerSettings:
    kw.setdefault("consume_adapters", False)
    return SamplerSettings(base_model="unused", served_model_name=BASE, adapter_cache_dir=tmp_path / "cache",
                           kafka=KafkaSettings(bootstrap_servers="memory://"), **kw)


class Harness:
    """A started sampler on the tiny model, its ASGI client, and the fetch calls it made."""

    def __init__(self, sampler: Sampler, client: httpx.AsyncClient, fetched: list) -> None:
        self.sampler, self.client, self.fetched = sampler, client, fetched

    async def complete(self, **body) -> dict:
        r = await self.client.post("/v1/completions", json={"prompt": PROMPT, **body})
        assert r.status_code == 200, r.text
        return r.json()

    async def load(self, name: str, path: Path) -> httpx.Response:
        return await self.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


@pytest.fixture
async def harness(request, tiny, tmp_path):
    """Overrides through ``@pytest.mark.parametrize('harness', [{...}], indirect=True)``."""
    overrides = dict(getattr(request, "param", {}))
    corrupt = overrides.pop("corrupt", False)
    down = overrides.pop("down", False)
    fetched: list = []
    served = {1: tiny["a"], 2: tiny["b"], 7: tiny["a"]}

    def fetcher(model_id, version, url, files_sha256, dest_dir):
        """Stands in for the publisher: copies the adapter that "version" maps to into ``dest_dir``."""
        fetched.append((model_id, version, url, files_sha256))
        if down:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        if version not in served:
            raise FileNotFoundError(f"publisher has no {model_id}@{version}")
        shutil.copytree(served[version], dest_dir, dirs_exist_ok=True)
        if corrupt:
            (dest_dir / "adapter_model.safetensors").write_bytes(b"tampered")
        return dest_dir

    settings = make_settings(tmp_path, **overrides)
    sampler = Sampler(settings, engine=Engine(tiny["base"]), fetcher=fetcher)
    await sampler.start()
    app = create_app(settings, sampler=sampler)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as client:
        yield Harness(sampler, client, fetched)
    await sampler.stop()


def announcement(tiny: dict[str, Path], version: int, adapter: str = "a", **kw) -> AdapterPublished:
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in tiny[adapter].iterdir() if p.name.startswith("adapter_")}
    return AdapterPublished(model_id="router", version=version, base_model=BASE, files_sha256=files,
                            url=f"http://publisher/v1/adapters/router/{version}", published_at=datetime.now(UTC),
                            **kw)


def assert_matches_forward_pass(tiny, adapter, choice: dict) -> None:
    expected, _ = teacher_forced(tiny, adapter, choice["prompt_token_ids"], choice["token_ids"])
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(expected) == len(choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(got, expected)) < TOL


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


# ------------------------------------------------------------------------------ pulls and the topic
async def test_announced_versions_are_pulled_verified_loaded_and_aliased(harness, tiny):
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    reg = harness.sampler.registry
    assert reg.alias_target("router") == "router@1" and reg.is_resident("router@1")
    assert harness.fetched[0][:2] == ("router", 1) and harness.fetched[0][3]  # pulled with the announced hashes
    via_alias = await harness.complete(model="router", max_tokens=4, temperature=0, logprobs=0,
                                       return_token_ids=True, ignore_eos=True)
    assert_matches_forward_pass(tiny, "a", via_alias["choices"][0])
    await harness.sampler.worker.handle(announcement(tiny, 2, "b"))
    assert reg.alias_target("router") == "router@2"
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))  # late replay: the alias stays
    assert reg.alias_target("router") == "router@2" and len(harness.fetched) == 2
    pinned = await harness.complete(model="router@1", max_tokens=4, temperature=0, logprobs=0,
                                    return_token_ids=True, ignore_eos=True)
    assert pinned["choices"][0]["token_ids"] == via_alias["choices"][0]["token_ids"]
    cards = {c["id"]: c for c in (await harness.client.get("/v1/models")).json()["data"]}
    assert {"router", "router@1", "router@2"} <= set(cards) and cards["router"]["root"] == cards["router@2"]["root"]


@pytest.mark.parametrize("harness", [{"publisher_url": "http://publisher"}], indirect=True)
async def test_unknown_version_is_fetched_on_demand_then_answered(harness, tiny):
    body = await harness.complete(model="router@7", max_tokens=4, temperature=0, logprobs=0,
                                  return_token_ids=True, ignore_eos=True)
    assert harness.fetched == [("router", 7, None, None)]  # unannounced: the publisher client checks hashes
    assert_matches_forward_pass(tiny, "a", body["choices"][0])
    missing = await harness.client.post("/v1/completions", json={"model": "router@8", "prompt": "x"})
    assert missing.status_code == 404 and "router@8" in missing.json()["reason"]


@pytest.mark.parametrize("harness", [{"publisher_url": "http://publisher", "down": True}], indirect=True)
async def test_a_version_whose_source_is_down_is_503_not_404(harness):
    """The publisher briefly unreachable is "try again", not "no such model"."""
    r = await harness.client.post("/v1/completions", json={"model": "router@7", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"] == "adapter_source_unreachable", r.json()
    assert "router@7" in r.json()["reason"] and r.json()["type"] == "ServiceUnavailableError"
    assert harness.fetched == [("router", 7, None, None)]


async def test_unknown_model_without_a_source_is_404_with_reason(harness):
    r = await harness.client.post("/v1/completions", json={"model": "router@7", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"] == "model_not_found" and "router@7" in r.json()["reason"]
    assert r.json()["type"] == "NotFoundError" and r.json()["param"] == "model" and harness.fetched == []


@pytest.mark.parametrize("harness", [{"corrupt": True}], indirect=True)
async def test_hash_mismatch_is_refused_and_names_the_file(harness, tiny):
    with pytest.raises(AdapterUnavailable, match="adapter_model.safetensors"):
        await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    reg = harness.sampler.registry
    assert reg.get("router@1") is None and reg.alias_target("router") is None and harness.sampler.eng.slots == []
    assert not harness.sampler.worker.store.dir_for("router", 1).exists()
    assert [p.name for p in harness.sampler.worker.store.dir_for("router", 1).parent.iterdir()] == []
    r = await harness.client.post("/v1/completions", json={"model": "router@1", "prompt": "x"})
    assert r.status_code == 404 and "adapter_model.safetensors" in r.json()["reason"]


@pytest.mark.parametrize("harness", [{"consume_adapters": True}], indirect=True)
async def test_adapters_topic_drives_the_worker(harness, tiny):
    await harness.sampler.bus.publish(topic("adapters"), announcement(tiny, 2, "b"))
    # the in-memory broker delivers on publish; allow a slow handoff anyway
    await eventually(lambda: harness.sampler.registry.alias_target("router") == "router@2", timeout_s=2,
                     interval_s=0.01, what="the worker to serve router@2 from the topic")
    assert harness.sampler.registry.alias_target("router") == "router@2"


async def test_restart_restores_verified_versions_from_the_cache(harness, tiny, tmp_path):
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    fresh = Sampler(harness.sampler.settings, engine=harness.sampler.eng, fetcher=lambda *a: pytest.fail("pulled"))
    await fresh.start()
    assert fresh.registry.alias_target("router") == "router@1" and not fresh.registry.is_resident("router@1")


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


async def test_plain_http_fetcher_pulls_the_announced_files(tiny, tmp_path):
    """The fallback fetcher over a real HTTP server: GET <url>/<file> for each announced file, then verify."""
    import functools
    import http.server
    import threading

    from services.sampler.worker import http_file_fetcher

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tiny["a"]))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = make_settings(tmp_path)
        sampler = Sampler(settings, engine=Engine(tiny["base"]), fetcher=http_file_fetcher(5.0))
        await sampler.start()
        msg = announcement(tiny, 3, "a").model_copy(update={"url": f"http://127.0.0.1:{server.server_port}/"})
        await sampler.worker.handle(msg)
        assert sampler.registry.alias_target("router") == "router@3" and sampler.registry.is_resident("router@3")
        assert (sampler.worker.store.dir_for("router", 3) / "adapter_model.safetensors").read_bytes() == \
            (tiny["a"] / "adapter_model.safetensors").read_bytes()
    finally:
        server.shutdown()
        server.server_close()


async def test_verified_but_unusable_download_is_not_kept(harness, tiny):
    """Hashes match, but the files are not a LoRA adapter: refused, deleted, nothing registered."""
    bogus = announcement(tiny, 1, "a").model_copy(update={"files_sha256": {
        "adapter_config.json": hashlib.sha256((tiny["a"] / "adapter_config.json").read_bytes()).hexdigest()}})
    harness.sampler.worker.store.fetcher = lambda m, v, u, f, dest: (
        shutil.copy(tiny["a"] / "adapter_config.json", dest), dest)[1]
    with pytest.raises(AdapterUnavailable, match="not loadable"):
        await harness.sampler.worker.handle(bogus)
    assert harness.sampler.registry.get("router@1") is None
    assert not harness.sampler.worker.store.dir_for("router", 1).exists()


async def test_loading_a_versioned_name_points_its_alias_and_inplace_keeps_it(harness, tiny):
    assert (await harness.load("router@1", tiny["a"])).status_code == 200
    assert harness.sampler.registry.alias_target("router") == "router@1"
    r = await harness.client.post("/v1/load_lora_adapter", json={
        "lora_name": "router@1", "lora_path": str(tiny["b"]), "load_inplace": True})
    assert r.status_code == 200 and harness.sampler.registry.alias_target("router") == "router@1"
    r = await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "router"})
    assert r.status_code == 200 and harness.sampler.registry.get("router@1") is not None  # alias only


async def test_pulls_through_the_real_publisher_and_its_client(tiny, tmp_path):
    """Publisher app + PublisherClient (in-process HTTP): an announced version, then one on demand."""
    from fastapi.testclient import TestClient

    from services.common.bus import Bus
    from services.common.publisher_client import PublisherClient
    from services.common.settings import RedisSettings
    from services.common.stamps import MemoryStampStore
    from services.publisher.app import Publisher
    from services.publisher.app import create_app as publisher_app
    from services.publisher.settings import PublisherSettings
    from services.sampler.worker import default_fetcher

    url = "http://publisher"
    pset = PublisherSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                             storage_dir=tmp_path / "store", public_url=url)
    publisher = Publisher(pset, Bus(pset.kafka), MemoryStampStore())
    with TestClient(publisher_app(pset, publisher=publisher), base_url=url) as http:
        client = PublisherClient(url, http=http)

        def publish(adapter: str) -> AdapterPublished:
            src = tmp_path / f"publish-{adapter}"
            src.mkdir()
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(tiny[adapter] / name, src / name)
            return AdapterPublished.model_validate(client.publish("router", src, BASE, {}))

        settings = make_settings(tmp_path, publisher_url=url)
        sampler = Sampler(settings, engine=Engine(tiny["base"]),
                          fetcher=default_fetcher(url, 5.0, client=client))
        await sampler.start()
        await sampler.worker.handle(publish("a"))
        assert sampler.registry.alias_target("router") == "router@1"
        v2 = publish("b")  # never handed to the worker: fetched when first asked for
        app = create_app(settings, sampler=sampler)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
            r = await c.post("/v1/completions", json={"model": f"router@{v2.version}", "prompt": PROMPT,
                                                      "max_tokens": 3, "temperature": 0, "logprobs": 0,
                                                      "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert_matches_forward_pass(tiny, "b", r.json()["choices"][0])
        assert sampler.registry.alias_target("router") == "router@2"


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


async def test_the_sampler_ignores_a_linear_router_announcement() -> None:
    """A linear version on the adapters topic is not a LoRA: the sampler's worker skips it (no pull)."""
    from services.common.adapter_files import LINEAR_ARTIFACT
    from services.sampler.worker import AdapterWorker

    msg = AdapterPublished(model_id="router", version=3, base_model="tfidf+logreg", url="http://pub/router/3",
                           files_sha256={LINEAR_ARTIFACT: "0" * 64}, published_at=datetime.now(UTC))
    worker = AdapterWorker.__new__(AdapterWorker)  # handle() must return before touching anything else
    worker.accept_base_models = ()
    await worker.handle(msg)


async def test_an_announcement_with_other_files_under_a_held_name_is_refused_and_counted(harness, tiny):
    """Two contents under one name (``router@1`` announced again with other files: a Redis that lost the
    publisher's stamp, a reused broker): refused with the files that differ, counted, the first one served."""
    from services.sampler.registry import AdapterConflict

    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    with pytest.raises(AdapterConflict, match="adapter_model.safetensors: .* here, .* announced"):
        await harness.sampler.worker.handle(announcement(tiny, 1, "b"))
    metrics = (await harness.client.get("/metrics")).text
    assert 'fanroute_sampler_adapter_events_total{event="conflict"} 1.0' in metrics
    body = await harness.complete(model="router@1", max_tokens=4, temperature=0, logprobs=0, return_token_ids=True,
                                  ignore_eos=True)
    assert_matches_forward_pass(tiny, "a", body["choices"][0])  # still the content it verified first
    assert len(harness.fetched) == 1


async def test_every_answer_names_the_adapter_content_that_gave_it(harness, tiny):
    """The header is the digest of what is loaded under the name (the manifest's digest for a published
    version, through an alias too); the base answers without one."""
    from services.common.adapter_files import ADAPTER_SHA256_HEADER, content_digest, dir_digest

    assert (await harness.load("lora-a", tiny["a"])).status_code == 200
    await harness.sampler.worker.handle(announcement(tiny, 2, "b"))
    named = {}
    for model in ("lora-a", "router", "router@2", BASE):
        r = await harness.client.post("/v1/completions", json={"prompt": PROMPT, "model": model, "max_tokens": 2})
        assert r.status_code == 200, r.text
        named[model] = r.headers.get(ADAPTER_SHA256_HEADER)
    assert named["lora-a"] == dir_digest(tiny["a"])
    assert named["router"] == named["router@2"] == content_digest(announcement(tiny, 2, "b").files_sha256)
    assert named["router@2"] != named["lora-a"] and named[BASE] is None
    chat = await harness.client.post("/v1/chat/completions", json={
        "model": "lora-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.headers[ADAPTER_SHA256_HEADER] == named["lora-a"]


async def test_a_subnormal_temperature_is_greedy_not_a_500(harness):
    """1.4e-45 overflows logits / temperature to inf (softmax NaN): vLLM treats under 1e-5 as greedy, so do we."""
    greedy = await harness.complete(max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    tiny_t = await harness.complete(max_tokens=6, temperature=1.401298464324817e-45, ignore_eos=True,
                                   return_token_ids=True)
    ids = greedy["choices"][0]["token_ids"]
    assert tiny_t["choices"][0]["token_ids"] == ids and len(ids) == 6
