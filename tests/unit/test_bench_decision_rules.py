"""bench/decision_rules.py on ADI traces: folds keep a query together, every rule × λ and the baselines get a
row pooled over the folds, the top-tier rule sends the unsure queries to the provider that shares every
label's top tier, λ moves decisions to the cheaper, the PNG is written; a missing run dir is a clear error."""

from __future__ import annotations

import pytest

from bench.decision_rules import LAMBDAS, RULES, evaluate, fold_of, main, plot
from services.evaluate.scoring import human_scores
from services.judge.calibration.human import QrelsStore
from tests.support.records import adi, adi_trace, episode

NAMES = ["cheap", "flaky", "good"]


def test_rules_and_lambdas_pooled_over_folds(tmp_path):
    qids = sorted(adi()[0], key=int)
    traces = {t.trace_id: t for t in (adi_trace(q) for q in qids)}
    eps = [episode(t.query, "cheap = good > flaky" if i % 2 else "flaky = good > cheap", NAMES, ep_id=f"e{i}",
                   trace_id=t.trace_id) for i, t in enumerate(traces.values())]
    assert {fold_of(ep, 3) for ep in eps} == {0, 1, 2} and fold_of(eps[0], 3) == fold_of(eps[0], 3)
    grades = {t: {"cheap": 2, "flaky": 2, "good": 3} for t in traces}
    store = QrelsStore()
    human = {t.trace_id: h for t in traces.values() if (h := human_scores(t, store))}
    report = evaluate(eps, traces, grades, human, 3, 0)
    rows = {r["policy"]: r for r in report["rows"]}
    assert len(rows) == len(RULES) * len(LAMBDAS) + 2 and all(r["n"] == len(eps) for r in rows.values())
    # 'good' is in every label's top tier: the top-tier rule (λ = 0) always picks it, the first choice never
    assert rows["top-tier λ=0"]["judge_grade"] == 3.0 and rows["first-choice λ=0"]["judge_grade"] == 2.0
    costs = [rows[f"top-tier λ={lam:g}"]["cost_per_query_usd"] for lam in LAMBDAS]
    assert costs == sorted(costs, reverse=True)  # a larger λ never buys a dearer choice
    plot(report["rows"], tmp_path / "rules.png")
    assert (tmp_path / "rules.png").stat().st_size > 0


def test_a_run_dir_without_a_demo_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--run-dir", str(tmp_path)])
    assert "must be a finished demo's output directory" in capsys.readouterr().err
