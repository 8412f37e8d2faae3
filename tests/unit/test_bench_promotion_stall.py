"""Smoke test of bench/promotion_stall.py on the tiny model: both settings measured in one run, every
load counted and merged, decisions in flight during the loads found. No timing is asserted (speed is
for the benchmark to report)."""

from __future__ import annotations

import json

import pytest

from bench.promotion_stall import main
from tests.support.tiny_model import build_tiny_model


def test_a_short_run_measures_both_settings(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    out_path = tmp_path / "promotion_stall.json"
    main(["--base", str(base), "--concurrency", "2", "--promotions", "2", "--steady-s", "0.5", "--gap-s", "0.2",
          "--warmup", "2", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["settings"]) == {"0", "3"}
    for r in out["settings"].values():
        assert len(r["load_s"]) == 2 and r["copies_merged"] == 1 + 2  # router@1, then each promotion's
        assert r["decisions"]["n"] > 0 and r["steady"]["n"] > 0 and r["over_router_timeout"] >= 0


@pytest.mark.parametrize("flag", ["--concurrency", "--promotions", "--attempts"])
def test_a_bad_count_is_refused_by_name_before_any_work(tmp_path, capsys, flag):
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit):
        main([flag, "0", "--out", str(out)])
    assert flag in capsys.readouterr().err and not out.exists()
