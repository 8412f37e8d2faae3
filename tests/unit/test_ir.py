"""Our nDCG@k agrees with ir-measures (pytrec_eval) on real qrels and random rankings."""

from __future__ import annotations

import random

import ir_measures
import pytest

from services.common.ir import ndcg_at_k
from services.providers.collections import (
    default_collections_dir,
    load_corpus,
    load_qrels,
)


def test_hand_computed():
    assert ndcg_at_k(["a", "b"], {"b": 1}, k=10) == pytest.approx(1 / 1.5849625007211563)
    assert ndcg_at_k(["b", "b", "a"], {"b": 1, "a": 1}, k=10) == pytest.approx(
        (1 + 0 + 1 / 2) / (1 + 1 / 1.5849625007211563))
    assert ndcg_at_k(["x"], {}, k=10) == 0.0


def test_matches_ir_measures_on_cranfield_graded_qrels():
    d = default_collections_dir()
    qrels = load_qrels(d, "cranfield")
    docs = [doc.doc_id for doc in load_corpus(d, "cranfield")]
    rng = random.Random(7)
    run = {}
    for qid, judged in list(qrels.items())[:40]:
        pool = list(judged) + rng.sample(docs, 20)
        rng.shuffle(pool)
        run[qid] = {doc: float(len(pool) - i) for i, doc in enumerate(dict.fromkeys(pool))}
    theirs = {m.query_id: m.value for m in ir_measures.iter_calc(
        [ir_measures.nDCG @ 10], qrels, run)}
    for qid, scores in run.items():
        ranked = sorted(scores, key=lambda doc: -scores[doc])
        assert ndcg_at_k(ranked, qrels[qid], 10) == pytest.approx(theirs[qid], abs=1e-4), qid
