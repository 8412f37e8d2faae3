"""The label ceiling, per collection: what the judge's first choice is worth on the human qrels beside
the collection's best single provider in hindsight, and where the two disagree — the judge's error modes.

A student distilled from the judge learns at best the judge's first choice (the judge-oracle); where
that choice is not the provider the humans' qrels favour for the collection, no amount of student
training closes the gap: the next judge change must. Diagnostic only: nothing is chosen or tuned from
it (the hindsight provider is computed on the held-out queries it describes, like the oracle).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from services.evaluate.policies import CANDIDATE, JUDGE_ORACLE, LINEAR, QueryScores


class CollectionRow(BaseModel):
    """One collection's held-out queries with qrels."""

    model_config = ConfigDict(frozen=True)
    collection: str
    queries: int = Field(description="Held-out queries of the collection with qrels and a judge verdict")
    hindsight_best: str = Field(description="The provider with the best mean nDCG@10 on these queries")
    hindsight_best_ndcg: float
    judge_oracle_ndcg: float
    candidate_ndcg: float | None = None
    linear_ndcg: float | None = None
    judge_first_not_best: int = Field(description="Queries where the judge's first choice is not hindsight_best")
    judge_first_counts: dict[str, int] = Field(default_factory=dict, description="The judge's first choices")


def _collection(query_id: str | None) -> str | None:
    return query_id.split("/", 1)[0] if query_id and "/" in query_id else None


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 6) if values else 0.0


def per_collection(scored: Sequence[QueryScores], outcomes: dict[str, list]) -> list[CollectionRow]:
    """A row per collection over the held-out queries that have qrels and a judge verdict
    (``outcomes``: policy → outcomes aligned with ``scored``)."""
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(scored):
        name = _collection(q.trace.query_id)
        if name is not None and q.human is not None and q.judge is not None:
            groups.setdefault(name, []).append(i)
    rows = []
    for name, idx in sorted(groups.items()):
        providers = scored[idx[0]].providers
        means = {p: _mean([float(scored[i].human.get(p, 0.0)) for i in idx]) for p in providers}  # type: ignore[union-attr]
        best = max(sorted(means), key=lambda p: means[p])
        firsts = [outcomes[JUDGE_ORACLE][i].called[0] for i in idx if outcomes[JUDGE_ORACLE][i].called]

        def policy_mean(policy: str) -> float | None:
            if policy not in outcomes:
                return None
            vals = [outcomes[policy][i].human for i in idx if outcomes[policy][i].human is not None]
            return _mean(vals) if vals else None

        rows.append(CollectionRow(
            collection=name, queries=len(idx), hindsight_best=best, hindsight_best_ndcg=means[best],
            judge_oracle_ndcg=policy_mean(JUDGE_ORACLE) or 0.0, candidate_ndcg=policy_mean(CANDIDATE),
            linear_ndcg=policy_mean(LINEAR), judge_first_not_best=sum(f != best for f in firsts),
            judge_first_counts=dict(Counter(firsts).most_common())))
    return rows


def render(rows: Sequence[CollectionRow]) -> list[str]:
    """The table ``fanroute eval`` prints under its policies."""
    if not rows:
        return []
    head = (f"{'collection':<10} {'n':>4} {'best in hindsight':<24} {'judge-oracle':>12} {'candidate':>9} "
            f"{'linear':>7}  judge's first choices (not the best: k)")
    out = ["", "the label ceiling per collection (nDCG@10 vs qrels; hindsight best on these queries, diagnostic only)",
           head, "-" * len(head)]
    for r in rows:
        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"
        firsts = ", ".join(f"{p} {c}" for p, c in r.judge_first_counts.items())
        out.append(f"{r.collection:<10} {r.queries:>4} {r.hindsight_best + f' {r.hindsight_best_ndcg:.3f}':<24} "
                   f"{r.judge_oracle_ndcg:>12.3f} {num(r.candidate_ndcg):>9} {num(r.linear_ndcg):>7}  "
                   f"{firsts} (not the best: {r.judge_first_not_best})")
    return out
