"""The relay under test: a counting stand-in for the sampler, a relay wired to in-process stores, and the
teacher-forced forward pass its records are checked against."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request

from services.common.settings import KafkaSettings, RedisSettings
from services.relay.app import create_app
from services.relay.sampling import SamplerClient
from services.relay.service import Relay
from services.relay.settings import RelaySettings
from tests.support.serving import free_port, served


def counting_sampler(reply_ids: tuple[int, ...] = (5, 6, 7), model: str = "fake-base", text: str = "ok") -> FastAPI:
    """A vLLM-shaped ``/v1/completions`` that answers fixed ids and counts every request it gets
    (``app.state.hits``): what the credential tests check stays at zero."""
    app = FastAPI()
    app.state.hits = []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        app.state.hits.append(body)
        return {"id": "cmpl-x", "object": "text_completion", "model": body.get("model"), "choices": [{
            "index": 0, "text": text, "token_ids": list(reply_ids), "finish_reason": "length", "stop_reason": None,
            "logprobs": {"token_logprobs": [-0.5] * len(reply_ids), "tokens": ["x"] * len(reply_ids),
                         "top_logprobs": [{}] * len(reply_ids), "text_offset": [0] * len(reply_ids)}}]}

    return app


def relay_settings(tokenizer: Path | str, **kw: Any) -> RelaySettings:
    kw.setdefault("kafka", KafkaSettings(bootstrap_servers="memory://"))
    kw.setdefault("redis", RedisSettings(url="memory://"))
    return RelaySettings(tokenizer=str(tokenizer), **kw)


@asynccontextmanager
async def relay_served(settings: RelaySettings, sampler_app: Any = None, **relay_kw: Any):
    """The relay served on loopback (the SDKs dial it like a harness would), talking to ``sampler_app``
    in process (or to ``settings.sampler_url``). Yields (base URL, the Relay)."""
    if sampler_app is not None:
        relay_kw["sampler"] = SamplerClient("http://sampler", 60, transport=httpx.ASGITransport(app=sampler_app))
    relay = Relay(settings, **relay_kw)
    async with served(create_app(settings, relay=relay), free_port(), what="relay", start_timeout_s=120) as url:
        yield url, relay


def teacher_forced(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], sampled: list[int]) -> list[float]:
    """Each sampled token's log-softmax under one plain transformers (+ peft) forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt_ids + sampled])).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV[len(prompt_ids) - 1:-1], dim=-1)
    return logp_TV.gather(1, torch.tensor(sampled)[:, None])[:, 0].tolist()


@asynccontextmanager
async def cpu_sampler(base_dir: Path, tmp_path: Path, adapters: dict[str, Path] | None = None):
    """The real CPU sampler on ``base_dir`` in this process (its ASGI app), with LoRA ``adapters``
    loaded by name through its ``/v1/load_lora_adapter``. Yields the app."""
    from services.sampler.app import create_app as sampler_app
    from services.sampler.engine import Engine
    from services.sampler.serving import Sampler
    from services.sampler.settings import SamplerSettings

    settings = SamplerSettings(base_model=str(base_dir), served_model_name="base", consume_adapters=False,
                               adapter_cache_dir=tmp_path / "sampler-cache", max_tokens_limit=256,
                               kafka=KafkaSettings(bootstrap_servers="memory://"))
    sampler = Sampler(settings, engine=Engine(base_dir))
    await sampler.start()
    app = sampler_app(settings, sampler=sampler)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as c:
            for name, path in (adapters or {}).items():
                r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                assert r.status_code == 200, r.text
        yield app
    finally:
        await sampler.stop()
