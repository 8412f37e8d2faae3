"""Smoke test of bench/console_pages.py at a tiny size: both sizes ingested through the store, every case
answered by the real app, ratios and RSS reported. No timing is asserted (speed is for the benchmark)."""

from __future__ import annotations

import json

from bench.console_pages import CASES, main


def test_a_short_run_measures_every_case_at_both_sizes(tmp_path):
    out_path = tmp_path / "console_pages.json"
    main(["--traces", "120", "--baseline", "60", "--requests", "3", "--warmup", "1", "--batch", "50",
          "--tmp", str(tmp_path), "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert list(out["sizes"]) == ["60", "120"]
    for n, size in out["sizes"].items():
        assert size["ingest"]["counts"]["traces"] == int(n) and size["ingest"]["counts"]["verdicts"] > 0
        assert set(size["pages"]) == set(CASES) and all(p["n"] == 3 for p in size["pages"].values())
        assert size["ingest"]["rss_mb"] > 0 and size["ingest"]["disk_mb"] > 0
    assert out["sizes"]["120"]["pages"]["deep"]["path"] == "/traces?page=3"
    assert set(out["ratio_p95"]) == set(CASES) and isinstance(out["target_met"], bool)
