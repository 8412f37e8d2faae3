"""Standard IR measures over human qrels (trec_eval's nDCG: linear gain, log2 discount)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def dcg(gains: Sequence[float]) -> float:
    """Discounted cumulative gain of gains in rank order."""
    return sum(g / math.log2(i + 2) for i, g in enumerate(gains))


def ndcg_at_k(ranked: Sequence[str], qrels: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k of a ranked doc-id list against graded judgments; unjudged docs gain 0.

    Duplicates in ``ranked`` gain only once, as in trec_eval. A query with no relevant
    document scores 0.
    """
    seen: set[str] = set()
    gains = []
    for doc in ranked[:k]:
        gains.append(max(qrels.get(doc, 0), 0) if doc not in seen else 0)
        seen.add(doc)
    ideal = dcg(sorted((g for g in qrels.values() if g > 0), reverse=True)[:k])
    return dcg(gains) / ideal if ideal > 0 else 0.0
