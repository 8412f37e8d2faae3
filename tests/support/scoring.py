"""The CPU sampler's scoring harness: a tiny model, a started sampler behind its ASGI client, and the
plain forward pass every returned logprob is checked against (tests/unit/test_sampler_scoring.py and
test_sampler_merged.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.common.prompt import router_messages
from services.common.settings import KafkaSettings
from services.sampler.app import create_app
from services.sampler.engine import Engine
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

TOL = 1e-4
BASE = "tiny-base"
NAMES = ("bio-dense", "bm25-all", "dense-all", "eng-bm25", "lib-bm25")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny base model with room for the router's prompt, and one LoRA adapter."""
    root = tmp_path_factory.mktemp("tiny-score")
    base = build_tiny_model(root / "base", context=512)
    return {"base": base, "a": build_lora_adapter(base, root / "lora-a", seed=1)}


_REFERENCE: dict[tuple[str, str | None], object] = {}


def reference_rows(tiny: dict[str, Path], adapter: str | None, ids: list[int]):
    """log_softmax of one plain forward pass of base (+ ``adapter``) over ``ids``: ``[len(ids), vocab]``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(tiny["base"]), adapter)
    if key not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(tiny["base"], dtype=torch.float32).eval()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(tiny[adapter])).eval()
        _REFERENCE[key] = model
    with torch.no_grad():
        return _REFERENCE[key](input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_prompt_logprobs_match(h: Harness, adapter: str | None, choice: dict, k: int) -> None:
    """The choice's prompt_logprobs (and its first sampled token's logprob) against a plain forward pass."""
    tiny, ids = h.tiny, choice["prompt_token_ids"]
    rows = reference_rows(tiny, adapter, ids + choice["token_ids"][:1])
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        row, entry = rows[pos - 1], got[pos]
        actual = str(ids[pos])
        assert next(iter(entry)) == actual  # the actual token first, as vLLM orders them
        expected = float(row[ids[pos]])
        assert abs(entry[actual]["logprob"] - expected) < TOL
        # 1-based vocabulary rank = how many logprobs are >= the token's (ties within TOL either way)
        assert int((row >= expected + TOL).sum()) <= entry[actual]["rank"] <= int((row >= expected - TOL).sum())
        top_v, top_i = row.topk(k)
        others = {int(t): v for t, v in entry.items() if t != actual}
        assert len(entry) in (k, k + 1) and set(others) <= set(top_i.tolist())
        for rank, (t, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), start=1):
            if t in others:
                assert abs(others[t]["logprob"] - v) < TOL and others[t]["rank"] == rank
        assert all(e["decoded_token"] == h.sampler.eng.token_text(int(t)) for t, e in entry.items())
    first = choice["logprobs"]["token_logprobs"][0]
    assert abs(first - float(rows[len(ids) - 1, choice["token_ids"][0]])) < TOL


class Harness:
    """A started sampler on the tiny model, its ASGI client, and the model files."""

    def __init__(self, sampler: Sampler, client: httpx.AsyncClient, tiny: dict[str, Path]) -> None:
        self.sampler, self.client, self.tiny = sampler, client, tiny

    async def score(self, prompt, *, k: int = 0, status: int = 200, **body) -> dict:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k, "logprobs": 0,
                "return_token_ids": True, **body}
        r = await self.client.post("/v1/completions", json=body)
        assert r.status_code == status, r.text
        return r.json()

    def router_prompts(self, query: str, names=NAMES) -> list[str]:
        tok = self.sampler.eng.tokenizer
        text = tok.apply_chat_template(router_messages(names, query), add_generation_prompt=True, tokenize=False)
        return [text + name for name in names]

    def metric(self, name: str, **labels) -> float:
        return self.sampler.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def harness(request, tiny, tmp_path):
    """Overrides of the sampler settings through ``@pytest.mark.parametrize('harness', [{...}], indirect=True)``."""
    settings = SamplerSettings(base_model="unused", served_model_name=BASE, adapter_cache_dir=tmp_path / "cache",
                               kafka=KafkaSettings(bootstrap_servers="memory://"), consume_adapters=False,
                               **dict(getattr(request, "param", {})))
    sampler = Sampler(settings, engine=Engine(tiny["base"]))
    await sampler.start()
    app = create_app(settings, sampler=sampler)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as client:
        yield Harness(sampler, client, tiny)
    await sampler.stop()
