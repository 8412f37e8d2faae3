"""bench/adapter_average.py: the stacked adapter's merged weights are the base plus the mean of the deltas."""

from __future__ import annotations

import json

import pytest

from tests.support.tiny_model import build_lora_adapter, build_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base") / "m")


def _merged(base, adapter):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().state_dict()


def test_the_average_merges_to_the_mean_of_the_merged_adapters(base, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from bench.adapter_average import average_adapters

    adapters = [build_lora_adapter(base, tmp_path / f"a{i}", seed=i) for i in range(3)]
    (adapters[0] / "top_tier_rates.json").write_text("{}")
    out = average_adapters(adapters, tmp_path / "avg")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (12, 24)  # 3 × r = 4, alpha scaled with it: same s = alpha / r
    assert (out / "top_tier_rates.json").read_text() == "{}"
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    each = [_merged(base, a) for a in adapters]
    avg = _merged(base, out)
    moved = 0
    for key, w in plain.items():
        mean_delta = sum(m[key] - w for m in each) / 3
        torch.testing.assert_close(avg[key] - w, mean_delta, atol=1e-5, rtol=1e-4)
        moved += bool(mean_delta.abs().max() > 1e-3)
    assert moved >= 6  # q, v, o of both layers: the check compared real deltas, not zeros


def test_adapters_of_different_shapes_are_refused_by_name(base, tmp_path):
    from bench.adapter_average import AverageError, average_adapters

    a = build_lora_adapter(base, tmp_path / "a", seed=0)
    b = build_lora_adapter(base, tmp_path / "b", seed=1, r=2)
    with pytest.raises(AverageError, match=r": r, lora_alpha differ"):
        average_adapters([a, b], tmp_path / "avg")
    c = build_lora_adapter(base, tmp_path / "c", seed=2, targets=("q_proj",))
    with pytest.raises(AverageError, match="target_modules differ"):
        average_adapters([a, c], tmp_path / "avg")
    with pytest.raises(AverageError, match="no adapters"):
        average_adapters([], tmp_path / "avg")


def test_sft_recipes_refuses_an_average_of_passes_it_does_not_train(tmp_path, capsys):
    from bench.sft_recipes import main

    with pytest.raises(SystemExit):
        main(["--episodes", str(tmp_path / "e.jsonl"), "--traces", str(tmp_path / "t.jsonl"),
              "--passes", "3", "--average-passes", "2,4"])
    assert "--average-passes [2, 4]: every pass must be within 1..--passes (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--episodes", "e", "--traces", "t", "--average-passes", "3"])
    assert "want two or more pass numbers" in capsys.readouterr().err
