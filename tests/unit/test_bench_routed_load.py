"""Smoke test of bench/routed_load.py: a two-second run at a low rate on the in-memory bus writes
both sides with requests in them. No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json

import pytest

from bench.fake_router import RouterBehaviour, decide
from bench.routed_load import main


def test_fake_router_outcomes_follow_the_shares_and_are_deterministic_per_query():
    b = RouterBehaviour(bad=0.2, slow=0.1, error=0.1, slow_ms=900, seed=3)
    draws = [decide(b, "router@1", f"q{i}", ["a", "b", "c"]) for i in range(2000)]
    share = {k: sum(d[0] == k for d in draws) / len(draws) for k in ("ok", "bad", "slow", "error")}
    assert share["bad"] == pytest.approx(0.2, abs=0.04) and share["slow"] == pytest.approx(0.1, abs=0.03)
    assert share["error"] == pytest.approx(0.1, abs=0.03)
    assert all(d[1] == 0.9 for d in draws if d[0] == "slow")
    assert all(sorted(d[2].split(" > ")) == ["a", "b", "c"] for d in draws if d[0] in ("ok", "slow"))
    assert decide(b, "router@1", "q7", ["a", "b", "c"]) == draws[7]
    with pytest.raises(ValueError):
        RouterBehaviour(bad=0.6, slow=0.6)


def test_a_short_run_reports_both_sides(tmp_path, monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    out_path = tmp_path / "routed_load.json"
    main(["--rate", "10", "--duration", "2", "--warmup", "0.5", "--progress", "1",
          "--fanout-fraction", "0.3", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert out["kafka"] == "memory://" and set(out["results"]) == {"fan-out", "routed"}
    for side in out["results"].values():
        assert side["requests"] > 0 and side["ok"] + side["errors"] == side["requests"]
        assert side["memory_mb"]["start"] > 0 and side["memory_mb"]["end"] > 0
        assert side["metrics_agree"], side["metrics_mismatch"]
    base, routed = out["results"]["fan-out"], out["results"]["routed"]
    assert set(base["modes"]) == {"fanout"} and base["provider_calls_per_request"] == 3
    assert routed["modes"].get("routed", 0) > 0
    assert set(out["ratio"]) == {"p50", "p99", "calls_per_request"}
