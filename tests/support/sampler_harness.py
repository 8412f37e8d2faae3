"""The CPU sampler's test harness on a tiny random Llama: the model and two LoRA adapters, a started sampler
behind its ASGI app with a stand-in publisher, announcements, and an independent forward pass to check
token logprobs against. Shared by the sampler's test modules (import the fixtures by name)."""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from schemas.adapter import AdapterPublished
from services.common.settings import KafkaSettings
from services.sampler.app import create_app
from services.sampler.engine import Engine
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

TOL = 1e-4


BASE = "tiny-base"


PROMPT = "which search provider should answer"


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
