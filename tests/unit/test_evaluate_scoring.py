"""Grading every answer of a held-out trace: the local judge's grades depend on the other answers
shown (so all of a query's answers, the fused list included, are graded in one call); human nDCG@10."""

from __future__ import annotations

import pytest

from services.evaluate.policies import FUSED
from services.evaluate.scoring import (
    fused_candidate,
    human_scores,
    judge_all,
    judge_grades,
    with_fused,
)
from services.judge.backends.local import LocalJudge
from services.judge.calibration.human import QrelsStore
from tests.support.fakes import KeywordJudge
from tests.support.records import adi, adi_trace, candidate, trace

Q = "boundary layer transition swept wings"
GOOD = candidate("good", ["u1", "u2"],
                 texts=[("boundary layer transition", "on swept wings at speed"), ("transition", "")])
OTHER = candidate("other", ["u3"], texts=[("boundary layer", "boundary layer theory")])
THIRD = candidate("third", ["u4", "u5"], texts=[("boundary layer transition", "x"), ("swept wings", "y")])


async def test_local_judge_grades_depend_on_the_other_candidates():
    """IDF is estimated over the request's own sources: adding an answer can move another's grade."""
    judge = LocalJudge()
    alone = await judge_grades(judge, trace("t", [GOOD, OTHER], query=Q))
    with_third = await judge_grades(judge, trace("t", [GOOD, OTHER, THIRD], query=Q))
    assert alone["other"] != with_third["other"]


async def test_the_fused_list_is_graded_blind_beside_the_providers():
    judge = KeywordJudge()
    t = trace("t", [candidate("a"), candidate("b", error="down")])
    grades = await judge_grades(judge, t)
    assert set(grades) == {"a", "b", FUSED} and grades["b"] == 0  # failed: 0 by rule, not shown
    shown = judge.requests[0]
    assert len(shown.candidates) == 2  # a and the fused list, as letters
    assert all("rrf" not in c.answer.lower() and "fused" not in c.answer.lower() for c in shown.candidates)


async def test_judge_failure_is_none_and_not_a_grade():
    t = trace("t", [candidate("a")])
    assert await judge_grades(KeywordJudge(fail=True), t) is None
    assert await judge_all(KeywordJudge(fail=True), [t], progress=False) == {"t": None}


def test_fused_candidate_is_the_rrf_list_and_empty_when_nobody_answered():
    t = trace("t", [candidate("a", ["u1", "u2"]), candidate("b", ["u2", "u3"])])
    f = fused_candidate(t)
    assert f.provider == FUSED and [c.url for c in f.citations][0] == "u2" and f.answer
    assert not fused_candidate(trace("t", [candidate("a", error="x")])).ok
    with pytest.raises(ValueError, match=FUSED):
        with_fused(trace("t", [candidate(FUSED)]))


def test_human_scores_use_the_collection_qrels_and_skip_queries_without():
    qid = next(iter(adi()[1]))
    scores = human_scores(adi_trace(qid), QrelsStore())
    assert scores["good"] == pytest.approx(1.0) and scores["cheap"] == 0.0
    assert 0.0 < scores[FUSED] < 1.0
    assert human_scores(trace("t", [candidate("a")], query_id="web/1"), QrelsStore()) is None
    assert human_scores(trace("t", [candidate("a")]), QrelsStore()) is None
