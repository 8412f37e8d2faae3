"""Smoke test of bench/router_forward.py on the tiny model: every variant timed, ratios and the int8 and
bf16 argmax agreement reported. No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json

from bench.router_forward import main
from tests.support.tiny_model import build_lora_adapter, build_tiny_model


def test_a_short_run_times_every_variant_and_checks_int8(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    adapter = build_lora_adapter(base, tmp_path / "lora", seed=1)
    out_path = tmp_path / "router_forward.json"
    main(["--base", str(base), "--adapter", str(adapter), "--reps", "2", "--prompts", "2", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["variants"]) == {"fp32 base", "fp32 lora", "fp32 lora merged", "bf16 base", "bf16 lora",
                                    "bf16 lora merged", "int8 dynamic, lora merged"}
    assert all(v["p50_ms"] > 0 for v in out["variants"].values())
    assert out["ratio_to_fp32_lora"]["fp32 lora"] == 1.0
    assert 0 <= out["int8_argmax_agreement"] <= 1 and 0 <= out["bf16_argmax_agreement"] <= 1
    assert out["cached_tokens"] > 0 and out["forwarded_tokens"] > 0
