"""bench/seed_spread.py: draw 0 is the demo's seeds, the target rule is issue 23's, bad flags are named."""

from __future__ import annotations

import pytest


def _row(gain_pct=21.0, cost_share=0.40, ci=(0.001, 0.04), ndcg=0.51, sha="a"):
    return {"gain_pct": gain_pct, "cost_share": cost_share, "ndcg10": ndcg, "adapter_sha256": sha,
            "vs_linear": {"mean_diff": 0.02, "ci95": list(ci) if ci else None}}


def test_offset_zero_seeds_the_passes_as_the_demo_does():
    from bench.seed_spread import pass_seed

    assert [pass_seed(0, k) for k in range(3)] == [0, 1, 2]  # services.tools.demo_loop._train: seed=k
    assert [pass_seed(2, k) for k in range(3)] == [2000, 2001, 2002]
    assert len({pass_seed(s, k) for s in range(50) for k in range(5)}) == 250  # no two passes share a seed


@pytest.mark.parametrize(("row", "met"), [
    (_row(), True),
    (_row(gain_pct=19.99), False),  # +20 % over best single, not rounded up
    (_row(cost_share=0.46), False),  # at most 45 % of its cost
    (_row(ci=(-0.001, 0.04)), False),  # the interval against the linear router above 0
    (_row(ci=None), False),
])
def test_the_target_is_issue_23s_three_quality_lines(row, met):
    from bench.seed_spread import meets

    assert meets(row) is met


def test_summary_spreads_the_draws_and_checks_draw_zero_against_the_demo():
    from bench.seed_spread import summary

    draws = [{**_row(ndcg=0.50, gain_pct=18.0, sha="demo"), "meets_target": False},
             {**_row(ndcg=0.52, gain_pct=22.0, sha="other"), "meets_target": True}]
    s = summary({"draws": draws, "demo": {"adapter_sha256": "demo"}})
    assert s["ndcg10"] == {"mean": 0.51, "sd": pytest.approx(0.0141, abs=1e-4), "min": 0.5, "max": 0.52}
    assert s["meet_target"] == 1 and s["offset0_is_the_demos_adapter"] is True
    assert summary({"draws": draws[::-1], "demo": {"adapter_sha256": "demo"}})["offset0_is_the_demos_adapter"] is False


def test_candidate_ndcg_reads_an_eval_report():
    from bench.seed_spread import candidate_ndcg

    assert candidate_ndcg({"policies": {"candidate": {"human": {"mean": 0.505, "n": 186}}}}) == 0.505
    assert candidate_ndcg({"policies": {}}) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0"], "--seeds must be within 1..50"),
    (["--passes", "6"], "--passes must be within 1..5"),
    ([], "train/episodes.jsonl is missing"),
])
def test_bad_flags_and_a_folder_without_a_demo_are_named(tmp_path, capsys, argv, message):
    from bench.seed_spread import main

    with pytest.raises(SystemExit) as exc:
        main(["--demo-dir", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
