"""Citation-overlap signals and reciprocal-rank fusion."""

from __future__ import annotations

import pytest

from schemas.trace import Candidate
from services.providers.fusion import rrf
from services.providers.signals import compute_signals, jaccard
from tests.support.records import candidate


def test_jaccard():
    assert jaccard({"a", "b"}, {"b", "c"}) == pytest.approx(1 / 3)
    assert jaccard(set(), set()) == 1.0
    assert jaccard({"a"}, set()) == 0.0


def test_signals_pairwise_mean_min_and_contested():
    cands = [candidate("x", ("u1", "u2")), candidate("y", ("u2", "u3")), candidate("z", ("u9",))]
    s = compute_signals(cands, threshold=0.2)
    assert s.pairwise_overlap == {"x|y": pytest.approx(1 / 3, abs=1e-6), "x|z": 0.0, "y|z": 0.0}
    assert s.mean_overlap == pytest.approx(1 / 9, abs=1e-6)
    assert s.min_overlap == 0.0
    assert s.contested and s.contested_threshold == 0.2
    assert not compute_signals(cands, threshold=0.1).contested


def test_failed_candidates_are_left_out_of_overlap():
    bad = Candidate(provider="w", latency_ms=1, cost_usd=0, error="timeout", error_kind="timeout")
    s = compute_signals([candidate("x", ("u1",)), candidate("y", ("u1",)), bad], threshold=0.5)
    assert s.pairwise_overlap == {"x|y": 1.0}
    assert (s.providers_ok, s.providers_failed, s.contested) == (2, 1, False)


def test_single_answer_is_not_contested():
    s = compute_signals([candidate("x", ("u1",))], threshold=0.9)
    assert s.pairwise_overlap == {} and s.mean_overlap == 1.0 and not s.contested


def test_rrf_scores_and_agreement():
    cands = [candidate("x", ("u1", "u2")), candidate("y", ("u2", "u1", "u3"))]
    fused = rrf(cands, k=60, limit=10)
    # u1: 1/61 + 1/62, u2: 1/62 + 1/61 -> tie broken by URL; u3 last
    assert [f.url for f in fused] == ["u1", "u2", "u3"]
    assert fused[0].score == pytest.approx(1 / 61 + 1 / 62)
    assert fused[0].providers == {"x": 1, "y": 2}
    assert fused[2].providers == {"y": 3}
    assert len(rrf(cands, limit=2)) == 2


def test_rrf_of_nothing_is_empty():
    assert rrf([]) == []
