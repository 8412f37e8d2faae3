"""The held-out figures split by the dev queries' halves: tuned-on and untouched queries reported apart."""

from __future__ import annotations

import pytest

from services.common.splits import dev_half
from services.evaluate.halves import by_dev_half, render
from services.evaluate.policies import Outcome, QueryScores
from tests.support.records import candidate, trace

#: ADI query ids in each half (fixed by the salted hash; checked below, so a changed salt fails here).
TUNE, VALIDATION = ("1", "2", "4"), ("3", "8", "12")


def _scored(qid: str, *, human: bool = True) -> QueryScores:
    t = trace(f"t-{qid}", [candidate("good"), candidate("cheap")], query_id=f"adi/{qid}")
    return QueryScores(trace=t, human={"good": 1.0, "cheap": 0.0} if human else None, judge={"good": 3, "cheap": 1})


def _outcome(policy: str, human: float | None) -> Outcome:
    return Outcome(policy=policy, called=("good",), returned="good", cost_usd=0.001, latency_ms=10.0,
                   human=human, judge=2.0)


def test_each_half_gets_its_own_queries_means_and_intervals():
    assert [dev_half(f"adi/{q}") for q in TUNE + VALIDATION] == ["tune"] * 3 + ["validation"] * 3
    qids = [*TUNE, *VALIDATION, "5"]
    scored = [_scored(q, human=(q != "5")) for q in qids]  # adi/5 has no qrels here: in neither row
    # the candidate wins on the validation half only; best single is 0.2 everywhere
    cand = [0.2, 0.2, 0.2, 0.8, 0.6, 0.7, 0.9]
    outcomes = {"candidate": [_outcome("candidate", v) for v in cand],
                "best_single": [_outcome("best_single", 0.2) for _ in qids],
                "judge_oracle": [_outcome("judge_oracle", 0.5) for _ in qids]}
    rows = {r.half: r for r in by_dev_half(scored, outcomes, {"candidate": "router@1"}, resamples=200)}
    tune, val = rows["tune"], rows["validation"]
    assert (tune.queries, val.queries) == (3, 3)
    assert tune.human == {"candidate": pytest.approx(0.2), "best_single": pytest.approx(0.2),
                          "judge_oracle": pytest.approx(0.5)}
    assert tune.gain_over_best_single == pytest.approx(0.0)
    assert val.human["candidate"] == pytest.approx(0.7) and val.gain_over_best_single == pytest.approx(2.5)
    [c] = val.comparisons  # candidate - best_single on the human measure (no linear row given)
    assert (c.a, c.b, c.measure, c.n, c.wins) == ("candidate", "best_single", "human", 3, 3)
    assert c.ci95 is not None and c.ci95[0] > 0
    assert tune.comparisons[0].ties == 3 and tune.comparisons[0].mean_diff == pytest.approx(0.0)
    assert "nothing" == val.chosen_on_it and "judge" in tune.chosen_on_it
    text = "\n".join(render(list(rows.values())))
    assert "tune half, 3 queries" in text and "validation half, 3 queries" in text and "+250.0%" in text


def test_no_query_with_qrels_gives_no_rows():
    scored = [_scored("1", human=False)]
    outcomes = {"candidate": [_outcome("candidate", None)], "best_single": [_outcome("best_single", None)]}
    assert by_dev_half(scored, outcomes, {}) == [] and render([]) == []
