"""Policy outcomes replayed from a fan-out trace: failover, router fallbacks, oracle, fan-out; the
figures over queries (gain share, percentiles, fallbacks) and paired comparisons."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.evaluate import policies as pol
from services.evaluate.metrics import POWER_Z, gain_share, paired, policy_metrics, power, summarise
from services.evaluate.policies import FUSED, Outcome, QueryScores, RouterCall
from tests.support.records import candidate, trace


def _q(*, b_fails: bool = False, human=True, judge=True) -> QueryScores:
    t = trace("t", [candidate("a", cost=0.001, latency=10), candidate("b", cost=0.004, latency=40,
                                                               error="down" if b_fails else None),
                         candidate("c", cost=0.002, latency=20)])
    h = {"a": 0.2, "b": 0.0 if b_fails else 0.9, "c": 0.5, FUSED: 0.6} if human else None
    j = {"a": 1, "b": 0 if b_fails else 3, "c": 2, FUSED: 2} if judge else None
    return QueryScores(t, h, j)


def test_router_top_choice_answers():
    o = pol.routed(_q(), "candidate", RouterCall(ordering=("b", "c"), router_ms=5.0), "a", 2)
    assert (o.called, o.returned, o.human, o.judge, o.fallback) == (("b",), "b", 0.9, 3, None)
    assert o.cost_usd == pytest.approx(0.004) and o.latency_ms == pytest.approx(45.0)


def test_failover_to_the_next_when_the_trace_shows_a_failure():
    o = pol.routed(_q(b_fails=True), "candidate", RouterCall(ordering=("b", "c"), router_ms=5.0), "a", 2)
    assert (o.called, o.returned, o.human, o.judge) == (("b", "c"), "c", 0.5, 2)
    assert o.latency_ms == pytest.approx(5 + 40 + 20)  # sequential: router, the failed call, the next
    assert o.cost_usd == pytest.approx(0.0 + 0.002)  # a failed call cost what the trace says (0 here)


def test_max_attempts_bounds_failover_and_nothing_returned_scores_zero():
    o = pol.routed(_q(b_fails=True), "candidate", RouterCall(ordering=("b", "c")), "a", 1)
    assert (o.called, o.returned, o.human, o.judge) == (("b",), None, 0.0, 0.0)


def test_ordering_then_fallback_then_the_rest():
    # The router names only b (failed): the best single provider a is next, not c.
    o = pol.routed(_q(b_fails=True), "candidate", RouterCall(ordering=("b",)), "a", 2)
    assert o.called == ("b", "a") and o.returned == "a"


@pytest.mark.parametrize("kind", ["unparseable", "router_timeout", "router_error"])
def test_router_failure_falls_back_to_best_single_and_is_counted(kind):
    o = pol.routed(_q(), "deployed", RouterCall(error_kind=kind, router_ms=2000.0), "a", 2)
    assert (o.called, o.returned, o.fallback, o.human) == (("a",), "a", kind, 0.2)
    assert o.latency_ms == pytest.approx(2010.0)  # the time lost asking counts
    m = policy_metrics("deployed", [o, pol.routed(_q(), "deployed", RouterCall(ordering=("c",)), "a", 2)])
    assert m.fallbacks == {kind: 1}


def test_best_single_has_the_same_failover():
    t = trace("t", [candidate("a", error="x"), candidate("b")])
    o = pol.single(QueryScores(t, {"a": 0.0, "b": 0.4}, None), "a", 2)
    assert o.called == ("a", "b") and o.returned == "b" and o.human == 0.4 and o.judge is None


def test_oracle_picks_per_measure_with_ties_to_the_cheapest():
    o = pol.oracle(_q())
    assert (o.human, o.judge, o.called) == (0.9, 3, ("b",))
    tied = QueryScores(_q().trace, {"a": 0.5, "b": 0.5, "c": 0.5}, {"a": 1, "b": 2, "c": 2})
    o = pol.oracle(tied)
    assert o.called == ("a",) and o.cost_usd == pytest.approx(0.001)  # human pick: cheapest of the tie
    assert o.judge == 2  # the judge column has its own pick (c, the cheaper of b and c)
    assert pol.oracle(_q(human=False)).called == ("b",)  # no qrels: cost of the judge pick


def test_fanout_returns_the_fused_list_costs_the_sum_and_waits_for_the_slowest():
    o = pol.fanout(_q())
    assert (o.returned, o.human, o.judge, o.called) == (FUSED, 0.6, 2, ("a", "b", "c"))
    assert o.cost_usd == pytest.approx(0.007) and o.latency_ms == 40
    dead = QueryScores(trace("t", [candidate("a", error="x"), candidate("b", error="y")]), {"a": 0, "b": 0}, None)
    assert pol.fanout(dead).returned is None and pol.fanout(dead).human == 0.0


def test_missing_measures_stay_missing():
    o = pol.routed(_q(human=False, judge=False), "candidate", RouterCall(ordering=("b",)), "a", 2)
    assert o.human is None and o.judge is None


def test_gain_share():
    assert gain_share(0.55, 0.5, 0.6) == pytest.approx(0.5)
    assert gain_share(0.45, 0.5, 0.6) == pytest.approx(-0.5)
    assert gain_share(0.6, 0.5, 0.5) is None  # the oracle gains nothing
    assert gain_share(None, 0.5, 0.6) is None


def _o(policy: str, human: float | None, judge: float | None, latency: float = 10.0) -> Outcome:
    return Outcome(policy, ("a",), "a", 0.001, latency, human, judge)


def test_metrics_means_skip_missing_and_percentiles():
    outs = [_o("p", 1.0, None, 10), _o("p", 0.0, 2, 20), _o("p", None, 3, 1000)]
    m = policy_metrics("p", outs)
    assert (m.human.mean, m.human.n, m.judge.mean, m.judge.n) == (0.5, 2, 2.5, 2)
    assert m.latency_p50_ms == 20 and 900 < m.latency_p99_ms <= 1000
    assert m.calls_per_query == 1 and m.unanswered == 0


def test_paired_comparison_and_seeded_bootstrap():
    a = [_o("a", h, None) for h in (0.5, 0.6, 0.4, 0.9)]
    b = [_o("b", h, None) for h in (0.4, 0.6, 0.5, None)]
    p = paired("a", "b", "human", a, b, seed=1)
    assert (p.n, p.wins, p.ties, p.losses) == (3, 1, 1, 1)
    assert p.mean_diff == pytest.approx(0.0)
    assert p.ci95 is not None and p.ci95[0] <= 0 <= p.ci95[1]
    assert paired("a", "b", "human", a, b, seed=1) == p  # seeded: reproducible
    assert paired("a", "b", "judge", a, b).n == 0


def test_the_power_figures_follow_the_spread_and_the_observed_difference():
    # 100 paired differences of +0.02 ± 0.2: SD 0.201 (ddof 1), so 2.80 · 0.201 / 10 detectable at 80 %
    diff_Q = np.array([0.22, -0.18] * 50)
    mde, needed = power(diff_Q)
    sd = float(diff_Q.std(ddof=1))
    assert mde == pytest.approx(POWER_Z * sd / 10, abs=1e-6) and mde == pytest.approx(0.0563, abs=1e-4)
    assert needed == math.ceil((POWER_Z * sd / abs(diff_Q.mean())) ** 2)  # (2.80 · SD / mean)², about 793
    assert 790 < needed < 800
    assert power(diff_Q * 2) == (pytest.approx(2 * mde), needed)  # both scale with the spread, n does not move
    assert power(diff_Q - 0.02)[1] is None  # no observed difference: no query count reaches it
    assert power(np.array([0.5])) == (None, None)
    assert power(np.array([0.1, 0.1, 0.1])) == (0.0, 2)  # no spread: any two queries show it
    a = [_o("a", h, None) for h in (0.5, 0.6, 0.4, 0.9)]
    b = [_o("b", h, None) for h in (0.4, 0.6, 0.5, 0.7)]
    p = paired("a", "b", "human", a, b)
    assert (p.mde80, p.n_needed) == power(np.array([0.1, 0.0, -0.1, 0.2]))


def test_summarise_adds_gain_shares_and_comparisons():
    qs = [_q(), _q(b_fails=True)]
    outcomes = {
        "candidate": [pol.routed(q, "candidate", RouterCall(ordering=("c",)), "a", 2) for q in qs],
        "best_single": [pol.single(q, "a", 2) for q in qs],
        "oracle": [pol.oracle(q) for q in qs],
        "fanout": [pol.fanout(q) for q in qs],
    }
    rows, comps = summarise(outcomes, {"candidate": "router@2"})
    # human: candidate 0.5, best single 0.2, oracle (0.9 + 0.5) / 2 = 0.7 -> 0.3 / 0.5
    assert rows["candidate"].oracle_gain_share["human"] == pytest.approx(0.6)
    assert rows["candidate"].adapter == "router@2"
    assert {(c.a, c.b, c.measure) for c in comps} == {("candidate", "best_single", "human"),
                                                       ("candidate", "best_single", "judge")}


def test_judge_oracle_is_the_judges_first_pick_scored_on_the_qrels():
    o = pol.judge_oracle(_q())
    assert (o.policy, o.called, o.returned, o.human, o.judge) == (pol.JUDGE_ORACLE, ("b",), "b", 0.9, 3)
    # the judge ties a and c at its top grade: the cheaper one (a) is its first, whatever the humans say
    tied = QueryScores(_q().trace, {"a": 0.1, "b": 0.0, "c": 0.8}, {"a": 2, "b": 1, "c": 2})
    o = pol.judge_oracle(tied)
    assert (o.returned, o.human, o.cost_usd) == ("a", 0.1, pytest.approx(0.001))
    assert pol.oracle(tied).human == 0.8  # the oracle sees the humans; the judge-oracle is bounded by the judge
    assert pol.judge_oracle(_q(judge=False)).human is None  # no verdict: no pick, left out of the means
    # equal grade and equal cost: by name, whichever answered faster in this run (the labels' rule)
    for fast, slow in (("a", "b"), ("b", "a")):
        t = trace("t", [candidate(fast, cost=0.001, latency=5), candidate(slow, cost=0.001, latency=500)])
        o = pol.judge_oracle(QueryScores(t, {"a": 0.2, "b": 0.7}, {"a": 2, "b": 2}))
        assert (o.returned, o.human) == ("a", 0.2)
    assert pol.JUDGE_ORACLE in pol.POLICIES
