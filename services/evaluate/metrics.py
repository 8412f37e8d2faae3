"""Per-policy figures over the held-out queries and paired comparisons between policies (pure numpy)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from services.evaluate.policies import BEST_SINGLE, LINEAR, ORACLE, ROUTERS, Outcome

MEASURES = ("human", "judge")
#: |difference| below this is a tie in paired comparisons (floating-point noise, not a win).
TIE_EPS = 1e-9


class MeasureStats(BaseModel):
    """Mean quality on one measure and over how many queries (those where the measure exists)."""

    model_config = ConfigDict(frozen=True)
    mean: float | None
    n: int


class PolicyMetrics(BaseModel):
    """One row of the report."""

    model_config = ConfigDict(frozen=True)
    policy: str
    adapter: str | None = Field(default=None, description="Served router name, for router policies")
    queries: int
    human: MeasureStats = Field(description="nDCG@10 of the results returned vs the human qrels")
    judge: MeasureStats = Field(description="The judge's 0-3 grade of the answer returned")
    calls_per_query: float
    cost_per_query_usd: float
    latency_p50_ms: float
    latency_p99_ms: float
    router_p50_ms: float | None = Field(default=None, description="Router policies: the router's own decision time")
    router_p99_ms: float | None = Field(default=None, description="Router policies: p99 of the decision time")
    fallbacks: dict[str, int] = Field(default_factory=dict,
                                      description="Router failures answered by the best single provider, by kind")
    fallback_examples: dict[str, str] = Field(default_factory=dict,
                                              description="The first failure message of each fallback kind")
    unanswered: int = Field(default=0, description="Queries where every provider tried failed")
    oracle_gain_share: dict[str, float | None] = Field(
        default_factory=dict, description="(policy - best_single) / (oracle - best_single) per measure")

    def measure(self, name: str) -> MeasureStats:
        return getattr(self, name)


class Paired(BaseModel):
    """Policy ``a`` minus policy ``b`` on one measure, query by query."""

    model_config = ConfigDict(frozen=True)
    a: str
    b: str
    measure: str
    n: int
    mean_diff: float | None
    wins: int
    ties: int
    losses: int
    ci95: tuple[float, float] | None = Field(default=None, description="Paired bootstrap, percentile")
    mde80: float | None = Field(
        default=None, description="The smallest true mean difference these queries detect 80 % of the time at "
                                  "a two-sided 5 % level: (z.975 + z.8) · SD(diff) / √n, the normal approximation")
    n_needed: int | None = Field(
        default=None, description="Queries that would detect the observed mean difference 80 % of the time, "
                                  "at this spread (None: no difference observed)")


def _values(outcomes: Sequence[Outcome], measure: str) -> np.ndarray:
    """Per-query values of ``measure`` (NaN where it does not exist), shape (Q,)."""
    return np.array([np.nan if (v := getattr(o, measure)) is None else v for o in outcomes], dtype=float)


def _mean(values_Q: np.ndarray) -> MeasureStats:
    ok_Q = ~np.isnan(values_Q)
    n = int(ok_Q.sum())
    return MeasureStats(mean=round(float(values_Q[ok_Q].mean()), 6) if n else None, n=n)


def gain_share(policy: float | None, best_single: float | None, oracle: float | None) -> float | None:
    """The share of the oracle's gain over the best single provider that ``policy`` recovers (None: no gain)."""
    if policy is None or best_single is None or oracle is None or oracle - best_single <= TIE_EPS:
        return None
    return round((policy - best_single) / (oracle - best_single), 6)


def policy_metrics(policy: str, outcomes: Sequence[Outcome], adapter: str | None = None) -> PolicyMetrics:
    """Means, calls, cost, latency percentiles and fallbacks of one policy over the queries."""
    latency_Q = np.array([o.latency_ms for o in outcomes], dtype=float)
    router_Q = np.array([o.router_ms for o in outcomes], dtype=float)
    routed = adapter is not None and len(router_Q) > 0
    examples: dict[str, str] = {}
    for o in outcomes:
        if o.fallback and o.fallback_detail:
            examples.setdefault(o.fallback, o.fallback_detail)
    return PolicyMetrics(
        policy=policy, adapter=adapter, queries=len(outcomes),
        human=_mean(_values(outcomes, "human")), judge=_mean(_values(outcomes, "judge")),
        calls_per_query=round(float(np.mean([len(o.called) for o in outcomes])), 6),
        cost_per_query_usd=round(float(np.mean([o.cost_usd for o in outcomes])), 8),
        latency_p50_ms=round(float(np.percentile(latency_Q, 50)), 3),
        latency_p99_ms=round(float(np.percentile(latency_Q, 99)), 3),
        router_p50_ms=round(float(np.percentile(router_Q, 50)), 3) if routed else None,
        router_p99_ms=round(float(np.percentile(router_Q, 99)), 3) if routed else None,
        fallbacks=dict(sorted(Counter(o.fallback for o in outcomes if o.fallback).items())),
        fallback_examples=examples,
        unanswered=sum(o.returned is None for o in outcomes))


def paired(a: str, b: str, measure: str, outcomes_a: Sequence[Outcome], outcomes_b: Sequence[Outcome], *,
           seed: int = 0, resamples: int = 2000) -> Paired:
    """``a − b`` on ``measure`` over the queries where both have it, with a seeded paired bootstrap 95% CI."""
    diff_Q = _values(outcomes_a, measure) - _values(outcomes_b, measure)
    diff_Q = diff_Q[~np.isnan(diff_Q)]
    n = len(diff_Q)
    if not n:
        return Paired(a=a, b=b, measure=measure, n=0, mean_diff=None, wins=0, ties=0, losses=0)
    ci = None
    if resamples > 0 and n > 1:
        idx_BQ = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
        means_B = diff_Q[idx_BQ].mean(axis=1)
        ci = (round(float(np.percentile(means_B, 2.5)), 6), round(float(np.percentile(means_B, 97.5)), 6))
    mde, needed = power(diff_Q)
    return Paired(a=a, b=b, measure=measure, n=n, mean_diff=round(float(diff_Q.mean()), 6),
                  wins=int((diff_Q > TIE_EPS).sum()), ties=int((np.abs(diff_Q) <= TIE_EPS).sum()),
                  losses=int((diff_Q < -TIE_EPS).sum()), ci95=ci, mde80=mde, n_needed=needed)


#: z(0.975) + z(0.8): a two-sided 5 % test that finds a true difference of this many standard errors 80 % of the time
POWER_Z = 1.959964 + 0.841621


def power(diff_Q: np.ndarray) -> tuple[float | None, int | None]:
    """(minimum detectable difference at 80 % power, queries needed for the observed one) of paired differences.

    Why: an interval that includes 0 says nothing by itself; beside the smallest difference this many
    queries can see, it says whether a target stated as "an interval above 0" was within reach."""
    n = len(diff_Q)
    if n < 2:
        return None, None
    sd = float(diff_Q.std(ddof=1))
    mean = abs(float(diff_Q.mean()))
    needed = max(2, math.ceil((POWER_Z * sd / mean) ** 2)) if mean > TIE_EPS else None  # ≥ 2: a spread at all
    return round(POWER_Z * sd / math.sqrt(n), 6), needed


def summarise(outcomes: Mapping[str, Sequence[Outcome]], adapters: Mapping[str, str], *,
              seed: int = 0, resamples: int = 2000) -> tuple[dict[str, PolicyMetrics], list[Paired]]:
    """Every policy's metrics (routers with their oracle-gain share) and the router comparisons.

    ``outcomes`` holds one list per policy, aligned query by query.
    """
    rows = {p: policy_metrics(p, outs, adapters.get(p)) for p, outs in outcomes.items()}
    base, best = rows.get(BEST_SINGLE), rows.get(ORACLE)
    for p in ROUTERS:
        if p in rows and base is not None and best is not None:
            share = {m: gain_share(rows[p].measure(m).mean, base.measure(m).mean, best.measure(m).mean)
                     for m in MEASURES}
            rows[p] = rows[p].model_copy(update={"oracle_gain_share": share})
    comparisons = []
    for a, b in (("candidate", "deployed"), ("candidate", BEST_SINGLE), ("candidate", LINEAR),
                 ("deployed", BEST_SINGLE), (LINEAR, BEST_SINGLE)):
        if a in outcomes and b in outcomes:
            comparisons += [paired(a, b, m, outcomes[a], outcomes[b], seed=seed, resamples=resamples)
                            for m in MEASURES]
    return rows, comparisons
