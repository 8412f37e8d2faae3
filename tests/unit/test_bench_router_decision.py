"""Smoke test of bench/router_decision.py on the tiny model: the three paths at two concurrencies, the
decisions named, the ratio reported. No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json

from bench.router_decision import main, score_decision
from tests.support.tiny_model import build_tiny_model


def test_score_decision_sums_the_candidate_tokens():
    def choice(*lps):
        return {"prompt_logprobs": [None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}]
                + [{str(i): {"logprob": lp, "rank": 2, "decoded_token": "y"}} for i, lp in enumerate(lps)]}
    assert score_decision([choice(-0.5, -0.5), choice(-0.9), choice(-0.2, -2.0)], ["a", "b", "c"], 2) == "b"


def test_a_short_run_reports_both_paths(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    out_path = tmp_path / "router_decision.json"
    main(["--base", str(base), "--decisions", "3", "--warmup", "1", "--concurrency", "1,2", "--gen-tokens", "2",
          "--progress", "0", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["results"]) == {f"{p}@{c}" for p in ("generate", "score", "first-token") for c in (1, 2)}
    assert all(r["n"] == 3 and r["p50"] > 0 for r in out["results"].values())
    assert all(r["undecided"] == 0 for k, r in out["results"].items() if k.startswith("score"))
    assert set(out["ratio_generate_over_score"]) == {"1", "2"} and out["adapter"]["r"] == 8
    assert out["sampler"]["score_requests"] >= 2 * (3 + 1)  # the score path's; first-token's come on top
    agree = out["agreement_first_token_vs_score"]
    assert agree["n"] == 6 and 0 <= agree["same"] <= 6 and set(out["ratio_score_over_first_token"]) == {"1", "2"}


def test_a_reference_run_is_compared_decision_by_decision(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    first, second = tmp_path / "fp32.json", tmp_path / "again.json"
    common = ["--base", str(base), "--decisions", "3", "--warmup", "1", "--concurrency", "1", "--paths",
              "score,first-token", "--progress", "0"]
    main([*common, "--out", str(first)])
    main([*common, "--reference", str(first), "--server", "inline", "--out", str(second)])
    out = json.loads(second.read_text())
    assert json.loads(first.read_text())["server"] == "process" and out["server"] == "inline"
    assert set(out["chosen"]) == {"score@1", "first-token@1"} and len(out["chosen"]["score@1"]) == 3
    agree = out["agreement_vs_reference"]
    assert agree["reference"] == str(first) and agree["reference_dtype"] == "float32"
    # same weights, same queries, the sampler in its own process or in the bench's: the same decisions
    assert agree["score@1"] == {"same": 3, "n": 3, "share": 1.0}


def test_a_missing_reference_is_refused_before_any_work(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--reference", str(tmp_path / "absent.json"), "--out", str(tmp_path / "out.json")])
    assert "--reference" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_queries_come_from_an_eval_report_or_a_jsonl(tmp_path):
    """An ``eval.json`` gives exactly the held-out queries it measured; a JSONL its ``query`` or user turn."""
    from pathlib import Path

    from bench.sampler_support import load_queries

    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"queries": [{"query": "wing flutter", "trace_id": "t1"}, {"query": "cells"}]}))
    assert load_queries(report) == ["wing flutter", "cells"]
    lines = tmp_path / "traces.jsonl"
    lines.write_text(json.dumps({"query": "a"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]}) + "\n")
    assert load_queries(Path(lines)) == ["a", "b"]


def test_rounds_repeat_the_queries_and_count_requests_per_forward(tmp_path):
    """``--rounds 2``: each level measures the queries twice; decisions are compared on the first round."""
    base = build_tiny_model(tmp_path / "tiny", context=4096)
    out_path = tmp_path / "rounds.json"
    main(["--base", str(base), "--decisions", "9", "--warmup", "1", "--concurrency", "3", "--paths",
          "score,first-token", "--rounds", "2", "--progress", "0", "--out", str(out_path)])
    out = json.loads(out_path.read_text())
    assert out["rounds"] == 2 and out["settings"]["score_batch_max_wait_ms"] == 10.0
    for r in out["results"].values():
        assert r["n"] == 18 and r["forwards"] >= 1 and 1 <= r["requests_per_forward"] <= 3
        assert len(r["round_p50"]) == 2  # one p50 per round; two equal rounds' medians bracket the whole's
        assert min(r["round_p50"]) - 1e-6 <= r["p50"] <= max(r["round_p50"]) + 1e-6
        assert all(0 < x <= r["max"] for x in r["round_p50"])
    assert out["agreement_first_token_vs_score"]["n"] == 9


def test_rounds_that_would_bring_a_cached_query_back_are_refused(tmp_path):
    import pytest

    base = build_tiny_model(tmp_path / "tiny", context=4096)
    with pytest.raises(SystemExit, match="prefix cache"):
        main(["--base", str(base), "--decisions", "3", "--warmup", "1", "--concurrency", "1", "--paths", "score",
              "--rounds", "2", "--progress", "0", "--out", str(tmp_path / "out.json")])


def test_zero_rounds_are_refused_before_any_work(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--rounds", "0", "--out", str(tmp_path / "out.json")])
    assert "--rounds" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_a_bad_merged_dtype_is_refused_by_name_before_any_work(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--merged-dtype", "int8", "--out", str(tmp_path / "out.json")])
    assert "--merged-dtype" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
