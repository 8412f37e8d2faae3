"""Merged serving copies (services/sampler/merged.py): a router version scored with its LoRA folded in.

The copy's numbers are checked against an independent transformers + peft forward pass, exactly as
the peft path's are (tests/unit/test_sampler_scoring.py); which versions get a copy, how many are
kept, and that the copy's cached keys/values never reach a generation or another slot.
"""

from __future__ import annotations

import pytest

from services.sampler.engine import Engine
from services.sampler.merged import PackedLinear, cache_key, merged_copy, packable
from tests.support.scoring import (  # noqa: F401 - tiny and harness are fixtures
    assert_prompt_logprobs_match,
    harness,
    tiny,
)


async def load(harness, name: str, path) -> None:
    r = await harness.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


async def test_a_router_version_is_scored_through_its_merged_copy(harness, tiny):
    """router@1 gets a copy (the default ``merged_models``); its prompt logprobs, cache hits included,
    equal a plain peft forward's; its prefix-cache entries sit under the copy's key, never the slot's."""
    await load(harness, "router@1", tiny["a"])
    await load(harness, "lora-a", tiny["a"])  # not a router id: scored through peft
    eng, registry = harness.sampler.eng, harness.sampler.registry
    router, plain = registry.get("router@1").slot, registry.get("lora-a").slot
    assert eng.merged == [router]
    model, key = eng.scoring_model(router)
    assert model is not eng.model and key == cache_key(router)
    for query in ("what is a cell?", "what is a wing?", "what is a cell?"):
        for name in ("router@1", "lora-a"):
            body = await harness.score(harness.router_prompts(query), k=2, model=name)
            for choice in body["choices"]:
                assert_prompt_logprobs_match(harness, "a", choice, 2)
    slots = {k[0] for k in eng.prefix_cache._entries}
    assert cache_key(router) in slots and plain in slots and router not in slots
    # a generation goes through peft and reuses none of the copy's keys/values
    reused = eng.prefill_tokens_reused
    gen = (await harness.client.post("/v1/completions", json={
        "model": "router@1", "prompt": harness.router_prompts("what is a cell?")[0], "max_tokens": 2,
        "temperature": 0})).json()
    assert gen["choices"][0]["text"] is not None and eng.prefill_tokens_reused == reused
    # (where scoring went through peft, the same generation does reuse what scoring cached)
    await harness.client.post("/v1/completions", json={
        "model": "lora-a", "prompt": harness.router_prompts("what is a cell?")[0], "max_tokens": 2, "temperature": 0})
    assert eng.prefill_tokens_reused > reused


@pytest.mark.parametrize("harness", [{"merged_copies": 1}], indirect=True)
async def test_the_newest_copies_are_kept_and_an_unload_drops_its_copy(harness, tiny):
    await load(harness, "router@1", tiny["a"])
    await load(harness, "router@2", tiny["a"])
    eng, registry = harness.sampler.eng, harness.sampler.registry
    one, two = registry.get("router@1").slot, registry.get("router@2").slot
    assert eng.merged == [two]
    model, key = eng.scoring_model(one)  # the older version still scores, through peft
    assert model is eng.model and key == one
    await harness.score(harness.router_prompts("what is a cell?"), model="router@2")
    assert cache_key(two) in {k[0] for k in eng.prefix_cache._entries}
    assert (await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "router@2"})).status_code == 200
    assert eng.merged == [] and cache_key(two) not in {k[0] for k in eng.prefix_cache._entries}


@pytest.mark.parametrize("harness", [{"merged_copies": 0}, {"merged_models": ()}], indirect=True)
async def test_no_copy_when_turned_off(harness, tiny):
    await load(harness, "router@1", tiny["a"])
    assert harness.sampler.eng.merged == []
    body = await harness.score(harness.router_prompts("what is a cell?"), k=1, model="router@1")
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, "a", choice, 1)


def test_a_bf16_copy_packs_its_linear_layers_where_the_cpu_can(tiny):
    """In bf16 on a CPU with oneDNN bf16 kernels every linear layer is packed once (elsewhere the copy
    is only merged); either way its logits are the peft model's up to bf16 rounding."""
    import torch

    eng = Engine(tiny["base"], dtype="bfloat16")
    eng.load_adapter("s", tiny["a"])
    copy = merged_copy(eng.model, "s")
    packed = [m for m in copy.modules() if isinstance(m, PackedLinear)]
    linear = [m for m in copy.modules() if type(m) is torch.nn.Linear]
    assert (bool(packed), bool(linear)) == ((True, False) if packable(torch.bfloat16) else (False, True))
    assert not any("lora" in name for name, _ in copy.named_modules())
    ids = torch.tensor([eng.encode("which provider answers a query about cells and wings")])
    with torch.inference_mode():
        eng._activate("s")
        want = eng.model(input_ids=ids).logits.float()
        got = copy(input_ids=ids).logits.float()
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    with pytest.raises(Exception, match="not loaded"):
        eng.merge("nope")


async def test_a_copy_that_cannot_be_built_leaves_the_version_served_through_peft(harness, tiny, monkeypatch):
    """The copy only saves time: when building it fails (say, no memory for a second set of weights) the
    version still loads and answers, through peft, and the failure is counted."""
    import services.sampler.merged as merged

    def no_memory(model, slot, **_):
        raise MemoryError("no room for a copy")

    monkeypatch.setattr(merged, "merged_copy", no_memory)
    await load(harness, "router@1", tiny["a"])
    assert harness.sampler.eng.merged == []
    assert harness.metric("fanroute_sampler_adapter_events_total", event="merge_failed") == 1
    assert harness.metric("fanroute_sampler_merged_copies") == 0
    body = await harness.score(harness.router_prompts("what is a cell?"), k=1, model="router@1")
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, "a", choice, 1)


async def test_the_copies_are_counted(harness, tiny):
    await load(harness, "router@1", tiny["a"])
    assert harness.metric("fanroute_sampler_merged_copies") == 1
    assert harness.metric("fanroute_sampler_adapter_events_total", event="merged") == 1
    assert (await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "router@1"})).status_code == 200
    assert harness.metric("fanroute_sampler_merged_copies") == 0


async def test_the_copy_is_built_while_the_version_is_served(harness, tiny, monkeypatch):
    """Building a copy takes seconds under load; the engine's lock is not held meanwhile, so the version
    being merged answers (through peft, numbers checked) while its copy is still being built."""
    import asyncio
    import threading

    import services.sampler.merged as merged

    building, release = threading.Event(), threading.Event()
    real = merged.merged_copy

    def slow(model, slot, **kw):
        building.set()
        assert release.wait(30), "the test never released the build"
        return real(model, slot, **kw)

    monkeypatch.setattr(merged, "merged_copy", slow)
    loading = asyncio.create_task(load(harness, "router@1", tiny["a"]))
    assert await asyncio.to_thread(building.wait, 30)
    eng = harness.sampler.eng
    assert eng.merged == []
    body = await harness.score(harness.router_prompts("what is a cell?"), k=1, model="router@1")
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, "a", choice, 1)
    release.set()
    await loading
    assert eng.merged == [harness.sampler.registry.get("router@1").slot]


def test_a_load_or_unload_during_the_build_is_not_missed(tiny, monkeypatch):
    """A copy built across an adapter load may be torn: it is thrown away and built again; a slot
    unloaded during its build gets no copy."""
    import services.sampler.merged as merged

    eng, real, calls = Engine(tiny["base"]), merged.merged_copy, []

    def racing(then):
        def build(model, slot, **kw):
            calls.append(slot)
            if len(calls) == 1:
                then()
            return real(model, slot, **kw)
        return build

    eng.load_adapter("s", tiny["a"])
    monkeypatch.setattr(merged, "merged_copy", racing(lambda: eng.load_adapter("t", tiny["a"])))
    assert eng.merge("s") is True and calls == ["s", "s"] and eng.merged == ["s"]
    model, _ = eng.scoring_model("s")
    assert not any(hasattr(m, "lora_A") for m in model.modules())  # the rebuilt copy holds no peft layer

    calls.clear()
    eng.load_adapter("u", tiny["a"])
    monkeypatch.setattr(merged, "merged_copy", racing(lambda: eng.unload_adapter("u")))
    assert eng.merge("u", keep=2) is False and eng.merged == ["s"]

    def torn(model, slot, **kw):  # the race broke the deep copy itself, and the slot is gone
        eng.unload_adapter("v")
        raise RuntimeError("dictionary changed size during iteration")

    eng.load_adapter("v", tiny["a"])
    monkeypatch.setattr(merged, "merged_copy", torn)
    assert eng.merge("v", keep=2) is False and eng.merged == ["s"]


@pytest.mark.parametrize("harness", [{"max_resident_adapters": 1}], indirect=True)
async def test_a_version_loaded_again_by_a_request_gets_its_copy_in_the_background(harness, tiny):
    """Evicted, then asked for: the request loads it again and is answered through peft; its copy is
    built by a background thread, not on the request's time."""
    import threading

    await load(harness, "router@1", tiny["a"])
    await load(harness, "lora-b", tiny["a"])  # evicts router@1 and its copy
    eng = harness.sampler.eng
    assert eng.merged == []
    body = await harness.score(harness.router_prompts("what is a wing?"), k=1, model="router@1")
    for choice in body["choices"]:
        assert_prompt_logprobs_match(harness, "a", choice, 1)
    for thread in [t for t in threading.enumerate() if t.name == "sampler-merge"]:
        thread.join(60)
    assert eng.merged == [harness.sampler.registry.get("router@1").slot]
    assert harness.metric("fanroute_sampler_merged_copies") == 1


@pytest.mark.parametrize("harness", [{"merged_dtype": "bfloat16"}], indirect=True)
async def test_a_bf16_scoring_copy_of_an_fp32_engine(harness, tiny):
    """``merged_dtype=bfloat16``: the router is scored through a bf16 copy while generation stays in the
    engine's fp32 (the relay's logprobs unchanged); its logprobs are peft fp32's up to bf16 rounding."""
    import torch

    from tests.support.scoring import reference_rows

    await load(harness, "router@1", tiny["a"])
    eng = harness.sampler.eng
    model, _ = eng.scoring_model(harness.sampler.registry.get("router@1").slot)
    assert model.dtype == torch.bfloat16 and eng.model.dtype == torch.float32
    body = await harness.score(harness.router_prompts("what is a cell?"), k=1, model="router@1")
    for choice in body["choices"]:
        ids = choice["prompt_token_ids"]
        want = reference_rows(tiny, "a", ids)
        got = [float(next(iter(e.values()))["logprob"]) for e in choice["prompt_logprobs"][1:]]
        exact = [float(want[pos - 1, ids[pos]]) for pos in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(got, exact)) < 0.1 * max(abs(b) for b in exact)


def test_the_scoring_dtype_follows_the_setting(monkeypatch):
    """``auto`` is bf16 only where the CPU has AMX (with AVX-512 BF16 alone bf16 is slower than fp32)."""
    import torch

    import services.sampler.merged as merged

    assert merged.scoring_dtype("same", torch.float32) == torch.float32
    assert merged.scoring_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert merged.scoring_dtype("float32", torch.bfloat16) == torch.float32
    monkeypatch.setattr(merged, "has_amx_bf16", lambda: False)
    assert merged.scoring_dtype("auto", torch.float32) == torch.float32
    monkeypatch.setattr(merged, "has_amx_bf16", lambda: True)
    assert merged.scoring_dtype("auto", torch.float32) == (torch.bfloat16 if merged.packable(torch.bfloat16)
                                                           else torch.float32)


def test_a_bad_merged_dtype_is_refused_by_name(tmp_path):
    from pydantic import ValidationError

    from services.sampler.settings import SamplerSettings

    with pytest.raises(ValidationError, match="merged_dtype"):
        SamplerSettings(base_model="unused", merged_dtype="int8", adapter_cache_dir=tmp_path)
    with pytest.raises(ValidationError, match="merged_build_attempts"):
        SamplerSettings(base_model="unused", merged_build_attempts=-1, adapter_cache_dir=tmp_path)


def test_a_bad_model_id_in_merged_models_is_refused_by_name(tmp_path):
    from pydantic import ValidationError

    from services.sampler.settings import SamplerSettings

    with pytest.raises(ValidationError, match="merged_models"):
        SamplerSettings(base_model="unused", merged_models=("router", "no spaces/here"),
                        adapter_cache_dir=tmp_path)
