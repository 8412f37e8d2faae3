"""Smoke test of bench/gateway_overhead.py: a short in-memory run measures all three rows (the in-process
fan-out, the plain proxy, the gateway) with CPU per process and the trace size, and the plot is drawn.
No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json

import pytest

from bench.gateway_overhead import main, trace_bytes
from bench.plot_gateway_overhead import plot


def test_the_trace_size_is_read_from_the_gateway_histogram():
    text = ("# TYPE fanroute_gateway_trace_bytes histogram\nfanroute_gateway_trace_bytes_bucket{le=\"+Inf\"} 4.0\n"
            "fanroute_gateway_trace_bytes_count 4.0\nfanroute_gateway_trace_bytes_sum 84000.0\n")
    assert trace_bytes(text) == 21000.0
    assert trace_bytes("fanroute_gateway_trace_bytes_count 0.0\n") is None


def test_a_short_run_reports_every_row_and_plots(tmp_path):
    out_path = tmp_path / "gw.json"
    main(["--requests", "30", "--concurrency", "5", "--snippet-chars", "100", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    rows = out["results"]
    assert list(rows) == ["plain asyncio fan-out", "plain Python proxy", "fanroute gateway (in-memory bus)"]
    gateway = rows["fanroute gateway (in-memory bus)"]
    assert set(gateway["cpu_ms_per_request"]) == {"providers", "gateway", "driver"}
    assert gateway["cpu_ms_per_request"]["gateway"] > 0 and gateway["spooled"] == 0
    assert gateway["trace_bytes_mean"] > 30 * 100  # thirty citations of 100 characters each, at least
    assert set(out["ratio"]) == {"plain Python proxy", "fanroute gateway (in-memory bus)"}
    plot([out_path], tmp_path / "gw.png")
    assert (tmp_path / "gw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.redis
def test_a_short_run_measures_workers_and_routed_mode_with_the_decision_apart(tmp_path, redis_url):
    out_path = tmp_path / "gw.json"
    main(["--requests", "30", "--concurrency", "5", "--snippet-chars", "100", "--workers", "2", "--routed",
          "--redis", redis_url, "--out", str(out_path)])
    rows = json.loads(out_path.read_text())["results"]
    workers, routed = rows["fanroute gateway (in-memory bus, 2 workers)"], rows["fanroute gateway (routed linear, "
                                                                                "in-memory bus)"]
    assert workers["cpu_ms_per_request"]["gateway"] > 0  # the workers' CPU, counted through the supervisor
    # the promoted linear router decided most requests (10 % keep fanning out), each in its own figure
    assert routed["router_decisions"] >= 20 and 0 < routed["router_p50_ms"] <= routed["router_p99_ms"]
    assert routed["routed_requests"]["router"] >= 20 and routed["routed_requests"].get("fallback", 0) == 0
    assert routed["trace_bytes_mean"] < rows["fanroute gateway (in-memory bus)"]["trace_bytes_mean"]  # one answer


def test_the_profile_is_a_flame_graph_or_collapsed_stacks_by_its_suffix(tmp_path, monkeypatch):
    import bench.gateway_overhead as go

    calls = []
    monkeypatch.setattr(go.shutil, "which", lambda name: "/usr/bin/py-spy")
    monkeypatch.setattr(go.subprocess, "Popen", lambda argv, **kw: calls.append(argv))
    go.profiler(123, tmp_path / "p.svg")
    go.profiler(123, tmp_path / "p.txt")
    assert [argv[argv.index("--format") + 1] for argv in calls] == ["flamegraph", "raw"]
    assert all(argv[:4] == ["py-spy", "record", "--pid", "123"] for argv in calls)


def test_routed_counts_are_the_measured_requests_with_fallbacks_by_reason():
    from bench.gateway_overhead import routed_count

    warm = ('fanroute_gateway_routed_total{path="router"} 190.0\nfanroute_gateway_routed_total{path="fallback"} 5.0\n'
            'fanroute_gateway_route_fallbacks_total{reason="no_adapter"} 5.0\n')
    end = ('fanroute_gateway_routed_total{path="router"} 217.0\nfanroute_gateway_routed_total{path="fallback"} 6.0\n'
           'fanroute_gateway_route_fallbacks_total{reason="no_adapter"} 5.0\n'
           'fanroute_gateway_route_fallbacks_total{reason="timeout"} 1.0\n')
    assert routed_count(end, warm) == {"router": 27.0, "fallback": 1.0, "fallback:timeout": 1.0}
    assert routed_count(end)["fallback:no_adapter"] == 5.0
    typed = ("# HELP fanroute_gateway_routed_total Routed requests by path\n"
             "# TYPE fanroute_gateway_routed_total counter\n" + end)  # one worker's exposition has type lines
    assert routed_count(typed, warm) == routed_count(end, warm)
