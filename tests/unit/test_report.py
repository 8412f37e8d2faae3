"""Scoring traces against human qrels: per provider, oracle, fan-out; ids never cross collections."""

from __future__ import annotations

import pytest

from schemas import Trace
from services.providers.collections import default_collections_dir, load_qrels
from services.tools.report import render, score_traces, write_report
from tests.support.records import candidate, trace


def _trace(qid: str, cands) -> Trace:
    return trace(qid, cands, query="q", query_id=qid)


def test_scores_providers_oracle_and_fanout(tmp_path):
    qrels = load_qrels(default_collections_dir(), "adi")
    qid, judged = next(iter(qrels.items()))
    rel = sorted(judged)
    good = candidate("good", tuple(f"collection://adi/{d}" for d in rel))
    # Same numeric ids, other collection: must score 0, not be mistaken for ADI documents.
    impostor = candidate("impostor", tuple(f"collection://cisi/{d}" for d in rel))
    rows = {r.policy: r for r in score_traces([_trace(f"adi/{qid}", [good, impostor])],
                                              default_collections_dir())}
    assert rows["good"].ndcg10 == pytest.approx(1.0)
    assert rows["impostor"].ndcg10 == 0.0
    assert rows["oracle (best per query)"].ndcg10 == pytest.approx(1.0)
    assert rows["fan-out (RRF fused)"].calls_per_query == 2.0
    assert rows["best single (good)"].ndcg10 == pytest.approx(1.0)
    assert "good" in render(list(rows.values()), 1)
    jpath, ppath = write_report(list(rows.values()), tmp_path)
    assert jpath.exists() and ppath.read_bytes()[:4] == b"\x89PNG"


def test_traces_without_qrels_are_left_out():
    t = _trace("web/abc", [candidate("x")])
    assert score_traces([t], default_collections_dir()) == []
