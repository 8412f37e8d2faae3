"""Smoke test of bench/relay_streaming.py on the tiny model: both relays measured at two concurrencies, the
same text from each, the ratios reported. No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json

from bench.relay_streaming import main
from tests.support.tiny_model import build_tiny_model


def test_a_short_run_reports_both_relays(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    out_path = tmp_path / "relay_streaming.json"
    main(["--base", str(base), "--requests", "3", "--warmup", "1", "--concurrency", "1,2", "--tokens", "8",
          "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["results"]) == {"1", "2"} and out["adapter"]["r"] == 8
    for r in out["results"].values():
        assert all(r[name]["ttft_ms"]["n"] == 3 and r[name]["total_ms"]["p50"] >= r[name]["ttft_ms"]["p50"] > 0
                   for name in ("decoded", "whole"))
        assert set(r["ratio_whole_over_decoded"]) == {"ttft", "total"}
