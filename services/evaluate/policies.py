"""What each policy would have returned for one held-out query, computed exactly from its fan-out trace.

Pure: no I/O. A fan-out trace holds every provider's answer (citations, latency, cost, error), so a
policy that calls providers one at a time in some order is replayed by reading the trace: the first
provider that answered is returned, every provider tried costs what the trace says, and the latency
is the router's time plus the sequential provider calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from schemas.trace import Candidate, Trace
from services.common.labels import best
from services.router.policy import call_order

#: The fan-out policy's answer (the RRF-fused list) as a candidate name in the judge's and humans' scores.
FUSED = "rrf-fused"
#: Policy names, in the order the report lists them.
CANDIDATE, DEPLOYED, BEST_SINGLE, ORACLE, FANOUT = "candidate", "deployed", "best_single", "oracle", "fanout"
JUDGE_ORACLE = "judge_oracle"
#: The linear router (TF-IDF + logistic regression) distilled from the same training episodes, in-process.
LINEAR = "linear"
POLICIES = (CANDIDATE, DEPLOYED, LINEAR, BEST_SINGLE, JUDGE_ORACLE, ORACLE, FANOUT)
ROUTERS = (CANDIDATE, DEPLOYED, LINEAR)


@dataclass(frozen=True)
class QueryScores:
    """One held-out trace and the quality of each answer in it, by candidate name (and :data:`FUSED`).

    ``human`` is nDCG@10 against the collection's qrels (None: the query has no qrels); ``judge`` is
    the judge's 0–3 grade (None: the judge failed on this trace). A failed provider scores 0 in both.
    """

    trace: Trace
    human: Mapping[str, float] | None
    judge: Mapping[str, int] | None

    @property
    def providers(self) -> tuple[str, ...]:
        return tuple(c.provider for c in self.trace.candidates)

    def candidate(self, name: str) -> Candidate:
        return next(c for c in self.trace.candidates if c.provider == name)


@dataclass(frozen=True)
class RouterCall:
    """What asking a router about one query gave: an ordering, or the kind of failure; and its time."""

    ordering: tuple[str, ...] = ()
    error_kind: str | None = None
    router_ms: float = 0.0
    raw: str = ""
    error: str = ""
    scores: dict[str, float] | None = None  # the scoring router: each provider's summed log-probability
    rates: Mapping[str, Mapping[str, float]] | None = None  # the top-tier table decided with (None: first choice)


@dataclass(frozen=True)
class Outcome:
    """One policy on one query: who was called, whose answer came back, and what it was worth.

    ``returned`` is None when every provider tried failed (the caller got nothing: quality 0).
    ``fallback`` names why a router policy answered with the best single provider instead.
    """

    policy: str
    called: tuple[str, ...]
    returned: str | None
    cost_usd: float
    latency_ms: float
    human: float | None
    judge: float | None
    fallback: str | None = None
    fallback_detail: str | None = None
    router_ms: float = 0.0


def attempt(trace: Trace, order: Sequence[str], max_attempts: int) -> tuple[tuple[str, ...], str | None]:
    """(called, returned): providers in ``order`` until one answered in the trace, at most ``max_attempts``."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    ok = {c.provider for c in trace.candidates if c.ok}
    called = []
    for name in order[:max_attempts]:
        called.append(name)
        if name in ok:
            return tuple(called), name
    return tuple(called), None


def _score(scores: Mapping[str, float] | None, returned: str | None) -> float | None:
    if scores is None:
        return None
    return float(scores.get(returned, 0.0)) if returned is not None else 0.0


def served(policy: str, q: QueryScores, called: tuple[str, ...], returned: str | None, *,
           router_ms: float = 0.0, fallback: str | None = None, fallback_detail: str | None = None) -> Outcome:
    """The outcome of calling ``called`` one after the other (after ``router_ms`` of routing)."""
    cands = [q.candidate(p) for p in called]
    return Outcome(policy=policy, called=called, returned=returned,
                   cost_usd=sum(c.cost_usd for c in cands),
                   latency_ms=router_ms + sum(c.latency_ms for c in cands),
                   human=_score(q.human, returned), judge=_score(q.judge, returned), fallback=fallback,
                   fallback_detail=fallback_detail, router_ms=router_ms)


def single(q: QueryScores, provider: str, max_attempts: int, policy: str = BEST_SINGLE) -> Outcome:
    """Always ``provider`` first, failing over to the rest in configured order (as a router would)."""
    called, returned = attempt(q.trace, call_order([], q.providers, provider), max_attempts)
    return served(policy, q, called, returned)


def routed(q: QueryScores, policy: str, call: RouterCall, fallback_provider: str, max_attempts: int) -> Outcome:
    """The router's ordering (then ``fallback_provider``, then the rest); on a router failure the
    best single provider answers, and the failure's kind is recorded as the fallback."""
    ordering = () if call.error_kind is not None else call.ordering
    order = call_order(ordering, q.providers, fallback_provider)
    called, returned = attempt(q.trace, order, max_attempts)
    return served(policy, q, called, returned, router_ms=call.router_ms, fallback=call.error_kind,
                  fallback_detail=(call.error[:300] or None) if call.error_kind else None)


def _best(q: QueryScores, scores: Mapping[str, float]) -> str:
    """The provider with the highest score; ties go to the cheapest, then by name (the labels' rule)."""
    return best(q.providers, scores, {n: q.candidate(n).cost_usd for n in q.providers})


def oracle(q: QueryScores) -> Outcome:
    """The best provider for this query in hindsight, per measure: one call.

    The human and the judge column may pick different providers; cost and latency are those of the
    human pick when the query has qrels, else of the judge pick.
    """
    human_pick = _best(q, q.human) if q.human is not None else None
    judge_pick = _best(q, q.judge) if q.judge is not None else None
    pick = human_pick or judge_pick or q.providers[0]
    c = q.candidate(pick)
    return Outcome(policy=ORACLE, called=(pick,), returned=pick if c.ok else None, cost_usd=c.cost_usd,
                   latency_ms=c.latency_ms, human=_score(q.human, human_pick), judge=_score(q.judge, judge_pick))


def judge_oracle(q: QueryScores) -> Outcome:
    """Per query the judge's first provider (its top grade; ties: cheapest, then by name), scored on both measures.

    This is the label ceiling: a student distilled from this judge can at best learn to name this provider,
    so its human score is the most such a student can reach. None of it when the judge failed on the query.
    """
    if q.judge is None:
        return Outcome(policy=JUDGE_ORACLE, called=(), returned=None, cost_usd=0.0, latency_ms=0.0,
                       human=None, judge=None)
    pick = _best(q, q.judge)
    c = q.candidate(pick)
    return Outcome(policy=JUDGE_ORACLE, called=(pick,), returned=pick if c.ok else None, cost_usd=c.cost_usd,
                   latency_ms=c.latency_ms, human=_score(q.human, pick if c.ok else None),
                   judge=_score(q.judge, pick if c.ok else None))


def fanout(q: QueryScores) -> Outcome:
    """Every provider at once, the RRF-fused list returned: cost is the sum, latency the slowest call."""
    cands = q.trace.candidates
    answered = any(c.ok and c.citations for c in cands)
    return Outcome(policy=FANOUT, called=q.providers, returned=FUSED if answered else None,
                   cost_usd=sum(c.cost_usd for c in cands), latency_ms=max(c.latency_ms for c in cands),
                   human=_score(q.human, FUSED if answered else None),
                   judge=_score(q.judge, FUSED if answered else None))
