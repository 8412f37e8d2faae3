"""The held-out figures split by what was tuned on their queries: the dev queries' tuning and validation halves.

The held-out split is drawn by its own hash, so about half of its queries lie in the *tuning* half of the
development queries (``services/common/splits.py``), on which the bundled verticals' BM25/LSA settings
(``bench/market_tune.py``) and the local judge's weight and cut points (``bench/judge_tune.py``) were chosen.
Nothing was chosen on the *validation* half. A gain that lives only on the tuning half is the tuning's,
not the router's; so ``fanroute eval`` reports each half beside the whole. Diagnostic only: the headline
(and promotion) stays the whole held-out set, and nothing is chosen from this split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from services.common.splits import Half, dev_half
from services.evaluate.metrics import Paired, summarise
from services.evaluate.policies import (
    BEST_SINGLE,
    CANDIDATE,
    JUDGE_ORACLE,
    LINEAR,
    Outcome,
    QueryScores,
)

#: What was chosen on each half (the same words in eval.json and on stdout).
CHOSEN_ON: dict[Half, str] = {
    "tune": "the bundled verticals' BM25/LSA settings and the local judge's weight and cut points",
    "validation": "nothing",
}
SHOWN = (CANDIDATE, LINEAR, BEST_SINGLE, JUDGE_ORACLE)


class HalfRow(BaseModel):
    """The held-out queries with qrels that lie in one half of the development queries."""

    model_config = ConfigDict(frozen=True)
    half: Half
    chosen_on_it: str = Field(description="What was tuned on this half's queries")
    queries: int
    human: dict[str, float | None] = Field(description="Policy → mean nDCG@10 vs the human qrels on these queries")
    gain_over_best_single: float | None = Field(
        default=None, description="candidate / best_single - 1 on the human measure (None: no candidate)")
    comparisons: list[Paired] = Field(default_factory=list, description="The candidate's paired comparisons, human measure")


def by_dev_half(scored: Sequence[QueryScores], outcomes: Mapping[str, Sequence[Outcome]], adapters: Mapping[str, str],
                *, seed: int = 0, resamples: int = 2000) -> list[HalfRow]:
    """A row per half over the held-out queries that have qrels (``outcomes`` aligned with ``scored``)."""
    groups: dict[Half, list[int]] = {"tune": [], "validation": []}
    for i, q in enumerate(scored):
        if q.human is not None and q.trace.query_id:
            groups[dev_half(q.trace.query_id)].append(i)
    rows = []
    for half, idx in groups.items():
        if not idx:
            continue
        sub = {p: [outs[i] for i in idx] for p, outs in outcomes.items()}
        metrics, comparisons = summarise(sub, adapters, seed=seed, resamples=resamples)
        human = {p: metrics[p].human.mean for p in SHOWN if p in metrics}
        cand, base = human.get(CANDIDATE), human.get(BEST_SINGLE)
        gain = round(cand / base - 1, 6) if cand is not None and base else None
        rows.append(HalfRow(half=half, chosen_on_it=CHOSEN_ON[half], queries=len(idx), human=human,
                            gain_over_best_single=gain,
                            comparisons=[c for c in comparisons if c.a == CANDIDATE and c.measure == "human"]))
    return rows


def render(rows: Sequence[HalfRow]) -> list[str]:
    """The lines ``fanroute eval`` prints for the split."""
    if not rows:
        return []
    out = ["", "by half of the dev queries (nDCG@10 vs qrels; diagnostic: the headline is the whole held-out set)"]
    for r in rows:
        means = ", ".join(f"{p} {'-' if v is None else f'{v:.3f}'}" for p, v in r.human.items())
        gain = "" if r.gain_over_best_single is None else f"; candidate vs best_single {r.gain_over_best_single:+.1%}"
        out.append(f"  {r.half} half, {r.queries} queries (tuned on it: {r.chosen_on_it}): {means}{gain}")
        for c in r.comparisons:
            ci = f" [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}]" if c.ci95 else ""
            diff = "-" if c.mean_diff is None else f"{c.mean_diff:+.3f}"
            out.append(f"    {c.a} - {c.b}: {diff}{ci} (wins/ties/losses {c.wins}/{c.ties}/{c.losses})")
    return out
