"""The candidate router on the cost–quality plane: its scores over the held-out queries swept over λ,
beside every single provider, random mixing, the per-domain best, the judge-oracle and the oracle.

One scoring call per query gives the router's probability for every provider, so the whole λ curve
is replayed offline from the fan-out traces (what each provider answered and cost) without asking
the router again. A query where the router failed is answered by the best single provider at every λ,
as the gateway would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from schemas.episode import Episode
from schemas.trace import Trace
from services.evaluate.baseline import NoBaseline, choose_best_single
from services.evaluate.frontier import FrontierReport, frontier_report
from services.evaluate.metrics import MEASURES, PolicyMetrics
from services.evaluate.policies import BEST_SINGLE, FANOUT, JUDGE_ORACLE, ORACLE, QueryScores, RouterCall
from services.router.scoring import quality

#: Baseline rows of the eval drawn as named points beside the curve.
POINTS = (BEST_SINGLE, JUDGE_ORACLE, ORACLE, FANOUT)
PER_DOMAIN = "per-domain best"


def _domain(query_id: str | None) -> str | None:
    from services.providers.markets import domain_of

    try:
        return domain_of(query_id.split("/", 1)[0]) if query_id and "/" in query_id else None
    except (StopIteration, KeyError):
        return None


def per_domain_choice(episodes: Sequence[Episode], traces: Sequence[Trace], fallback: str) -> dict[str, str]:
    """Domain → the provider the training episodes of that domain rank first most (as the best single is
    chosen overall), the domain read from each episode's trace's query id."""
    query_of = {t.trace_id: t.query_id for t in traces}
    by_domain: dict[str, list[Episode]] = {}
    for ep in episodes:
        domain = _domain(query_of.get(ep.trace_id or ""))
        if domain is not None:
            by_domain.setdefault(domain, []).append(ep)
    out = {}
    for domain, eps in by_domain.items():
        try:
            out[domain] = choose_best_single(eps).provider
        except NoBaseline:
            out[domain] = fallback
    return out


def _quality(q: QueryScores, measure: str, names: Sequence[str]) -> list[float]:
    """What each provider's answer was worth on this query (0 for one that failed; NaN: no measure)."""
    scores = q.human if measure == "human" else q.judge
    if scores is None:
        return [float("nan")] * len(names)
    ok = {c.provider for c in q.trace.candidates if c.ok}
    return [float(scores.get(n, 0.0)) if n in ok else 0.0 for n in names]


def candidate_curves(scored: Sequence[QueryScores], calls: Mapping[str, RouterCall], rows: Mapping[str, PolicyMetrics],
                     best_single: str, domain_choice: Mapping[str, str]) -> dict[str, FrontierReport]:
    """Measure → the candidate's frontier report; empty when the router gave no scores (generate mode) or
    the held-out traces do not share one provider set."""
    names = sorted(scored[0].providers) if scored else []
    if not names or any(sorted(q.providers) != names for q in scored):
        return {}
    if not any(calls[q.trace.trace_id].scores for q in scored):
        return {}
    P_QP = np.zeros((len(scored), len(names)))
    for i, q in enumerate(scored):
        call = calls[q.trace.trace_id]
        if call.scores and call.error_kind is None:
            probs = quality(call.scores, call.rates)  # what the decision maximises, as the gateway's
            P_QP[i] = [probs.get(n, 0.0) for n in names]
        else:
            P_QP[i, names.index(best_single)] = 1.0
    cost_P = np.array([np.mean([q.trace.candidates[[c.provider for c in q.trace.candidates].index(n)].cost_usd
                                for q in scored]) for n in names])
    out = {}
    for measure in MEASURES:
        quality_QP = np.array([_quality(q, measure, names) for q in scored])
        if np.isnan(quality_QP).all():
            continue
        baselines = {p: (rows[p].cost_per_query_usd, rows[p].measure(measure).mean) for p in POINTS
                     if p in rows and rows[p].measure(measure).mean is not None}
        domain_pick = [domain_choice.get(_domain(q.trace.query_id) or "", best_single) for q in scored]
        ok_Q = ~np.isnan(quality_QP[:, 0])
        if domain_choice and ok_Q.any():
            picks_Q = np.array([names.index(p) for p in domain_pick])
            idx = np.arange(len(scored))
            baselines[PER_DOMAIN] = (float(cost_P[picks_Q][ok_Q].mean()), float(quality_QP[idx, picks_Q][ok_Q].mean()))
        out[measure] = frontier_report(measure, P_QP, cost_P, quality_QP, names, baselines=baselines)
    return out
