"""The cost–quality frontier: sweep, hulls, AIQ, APGR and CPT on hand-made cases computed in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.evaluate.frontier import (
    FrontierReport, NamedPoint, Point, aiq, build_report, frontier_report, lambda_grid, oracle_point, plot, render,
    single_points, sweep, upper_frontier, weak_strong)

WEAK, STRONG = NamedPoint(name="weak", cost=1, quality=0.2), NamedPoint(name="strong", cost=3, quality=0.8)

# 3 queries x providers a, b, c costing 1, 2, 4 per call
COST_P = [1.0, 2.0, 4.0]
NAMES = ["a", "b", "c"]
P_QP = [[0.2, 0.3, 0.5],
        [0.6, 0.3, 0.1],
        [0.1, 0.5, 0.4]]
QUALITY_QP = [[0.0, 0.5, 1.0],
              [1.0, 0.0, 0.0],
              [0.0, 1.0, 0.5]]


def _router(*points: tuple[float, float]) -> list[Point]:
    return [Point(lam=i, cost=c, quality=q) for i, (c, q) in enumerate(points)]


def test_the_two_provider_example() -> None:
    r = build_report("judge", _router((1, 0.2), (2, 0.8), (3, 0.8)), [WEAK, STRONG])
    assert r.router_frontier == [(1, 0.2), (2, 0.8)]  # (3, 0.8) is no better than the cheaper (2, 0.8)
    assert r.cost_range == (1, 3)  # cheapest to dearest single provider
    # ((0.2 + 0.8)/2 · 1 + 0.8 · 1) / 2
    assert r.aiq_router == pytest.approx(0.65)
    # the chord (1, 0.2)–(3, 0.8): its mean height (0.2 + 0.8)/2
    assert r.aiq_mixing == pytest.approx(0.5)
    # PGR 0 → 1 over [1, 2], then 1: ((0 + 1)/2 · 1 + 1 · 1) / 2
    assert r.apgr == pytest.approx(0.75)
    # PGR 0.5 = quality 0.5 on the slope 0.6/1 from (1, 0.2): 1 + 0.3/0.6; PGR 0.8 = 0.68: 1 + 0.48/0.6
    assert (r.cpt50, r.cpt80) == (pytest.approx(1.5), pytest.approx(1.8))
    assert (r.cpt50_share, r.cpt80_share) == (pytest.approx(0.5), pytest.approx(0.6))  # of the strong's 3
    assert (r.weak, r.strong, r.gap_note) == ("weak", "strong", None)
    assert FrontierReport.model_validate_json(r.model_dump_json()) == r


def test_dominated_and_under_the_chord_points_drop_out() -> None:
    # (2.5, 0.5) is dominated by (2, 0.8); (1.5, 0.3) lies under the chord (1, 0.2)–(2, 0.8), which is 0.5 there;
    # (1, 0.1) costs as much as (1, 0.2) and is worse
    assert upper_frontier([(2.5, 0.5), (1, 0.2), (1.5, 0.3), (2, 0.8), (3, 0.8), (1, 0.1)]) == [(1, 0.2), (2, 0.8)]
    # (1.5, 0.6) is above that chord: a vertex
    assert upper_frontier([(1, 0.2), (1.5, 0.6), (2, 0.8)]) == [(1, 0.2), (1.5, 0.6), (2, 0.8)]


def test_the_frontier_is_flat_right_of_its_best_point() -> None:
    frontier = [(1, 0.2), (2, 0.8)]
    assert aiq(frontier, (2, 4)) == pytest.approx(0.8)
    assert aiq(frontier, (1, 4)) == pytest.approx((0.5 + 0.8 * 2) / 3)  # 0.7
    assert aiq(frontier, (1.5, 1.5)) == pytest.approx(0.5)  # an empty range: R̃ there
    with pytest.raises(ValueError, match="left of the frontier"):
        aiq(frontier, (0.5, 2))


def test_left_of_the_router_the_cheapest_provider_anchors_and_the_range_is_clipped() -> None:
    # the router never reaches cost 1; the weak provider's point (1, 0.2) starts its frontier
    r = build_report("judge", _router((2, 0.8), (3, 0.8)), [WEAK, STRONG], cost_range=(0.0, 3.0))
    assert r.router_frontier == [(1, 0.2), (2, 0.8)]
    assert r.cost_range == (1, 3)  # nothing is cheaper than the cheapest provider
    assert (r.aiq_router, r.apgr) == (pytest.approx(0.65), pytest.approx(0.75))


def test_a_router_equal_to_random_mixing() -> None:
    # its points lie on the singles' chord: PGR rises linearly from 0 to 1, so its mean is 1/2
    r = build_report("human", _router((1, 0.2), (2, 0.5), (3, 0.8)), [WEAK, STRONG])
    assert r.router_frontier == [(1, 0.2), (3, 0.8)]  # the collinear middle point is no vertex
    assert r.apgr == pytest.approx(0.5)
    assert r.aiq_router == pytest.approx(r.aiq_mixing) == pytest.approx(0.5)
    # quality 0.5 at 1 + 0.3/0.3 = 2; 0.68 at 1 + 0.48/0.3 = 2.6
    assert (r.cpt50, r.cpt80) == (pytest.approx(2.0), pytest.approx(2.6))


def test_a_router_that_never_reaches_80_percent() -> None:
    # PGR of 0.6 is (0.6 - 0.2)/0.6 = 2/3: 50 % at 1 + 0.3/0.4 = 1.75, never 80 %
    r = build_report("judge", _router((1, 0.2), (2, 0.6)), [WEAK, STRONG])
    assert r.cpt50 == pytest.approx(1.75) and r.cpt80 is None and r.cpt80_share is None
    assert "CPT(80%) - $" in render(r)


def test_the_mixing_hull_and_the_default_range_over_three_singles() -> None:
    singles = [NamedPoint(name=n, cost=c, quality=q) for n, c, q in
               (("A", 1, 0.2), ("B", 2, 0.3), ("C", 3, 0.8), ("D", 4, 0.7))]
    r = build_report("judge", _router((1, 0.2)), singles)
    # B is under the chord A–C (0.5 at cost 2), D is dominated by C
    assert [s.name for s in r.mixing_hull] == ["A", "C"]
    assert r.cost_range == (1, 4)
    assert r.aiq_mixing == pytest.approx((0.5 * 2 + 0.8 * 1) / 3)  # 0.6
    assert r.aiq_router == pytest.approx(0.2) and r.apgr == pytest.approx(0.0) and r.cpt50 is None


def test_weak_and_strong_ties_go_to_the_better_and_the_cheaper() -> None:
    singles = [NamedPoint(name=n, cost=c, quality=q) for n, c, q in
               (("X", 1, 0.5), ("Y", 1, 0.6), ("Z", 2, 0.9), ("W", 3, 0.9))]
    weak, strong = weak_strong(singles)
    assert (weak.name, strong.name) == ("Y", "Z")


@pytest.mark.parametrize("dear", [0.8, 0.5])
def test_no_quality_gap_leaves_apgr_and_cpt_undefined(dear: float) -> None:
    # the cheapest provider is as good as (or better than) the dearer one: it is weak and strong at once
    singles = [NamedPoint(name="cheap", cost=1, quality=0.8), NamedPoint(name="dear", cost=3, quality=dear)]
    r = build_report("human", _router((1, 0.8), (3, dear)), singles)
    assert (r.weak, r.strong) == ("cheap", "cheap")
    assert r.apgr is None and r.cpt50 is None and r.cpt80 is None and r.cpt50_share is None
    assert r.gap_note is not None and "no quality gap" in r.gap_note
    assert r.aiq_router == pytest.approx(0.8) == r.aiq_mixing
    assert "no quality gap" in render(r)


def test_the_sweep_at_zero_a_tie_and_a_large_lambda() -> None:
    # λ = 0: the highest P per query is c, a, b → cost (4 + 1 + 2)/3, quality (1 + 1 + 1)/3
    # λ = 0.1: q0 scores 0.2-0.1, 0.3-0.2, 0.5-0.4 tie → the cheapest a; q1 a (0.5); q2 b (0.5-0.2 = 0.3)
    #   → cost (1 + 1 + 2)/3, quality (0 + 1 + 1)/3
    # λ = 100: always the cheapest a → cost 1, quality 1/3
    points = sweep(P_QP, COST_P, QUALITY_QP, [0.0, 0.1, 100.0], NAMES)
    assert [p.lam for p in points] == [0.0, 0.1, 100.0]
    assert [(p.cost, p.quality) for p in points] == [
        (pytest.approx(7 / 3), pytest.approx(1.0)), (pytest.approx(4 / 3), pytest.approx(2 / 3)),
        (pytest.approx(1.0), pytest.approx(1 / 3))]
    with pytest.raises(ValueError, match="λ must be >= 0"):
        sweep(P_QP, COST_P, QUALITY_QP, [-1.0])


def test_equal_cost_and_score_go_to_the_name() -> None:
    # zeta and alpha cost the same and score the same: alpha, whose quality is 1
    assert sweep([[0.5, 0.5]], [1.0, 1.0], [[0.0, 1.0]], [0.0], ["zeta", "alpha"])[0].quality == 1.0


def test_rows_without_the_measure_are_left_out() -> None:
    quality_QP = [*QUALITY_QP, [math.nan, 1.0, 1.0]]
    assert sweep([*P_QP, [0.0, 0.0, 1.0]], COST_P, quality_QP, [0.0], NAMES)[0].cost == pytest.approx(7 / 3)
    assert [s.quality for s in single_points(quality_QP, COST_P, NAMES)] == [
        pytest.approx(1 / 3), pytest.approx(0.5), pytest.approx(0.5)]


def test_the_lambda_grid_spans_pure_quality_to_always_cheapest() -> None:
    # the first λ that changes a choice: q0's c (0.5 at cost 4) meets a at (0.5-0.2)/3 = 0.1 and b at
    # (0.5-0.3)/2 = 0.1 (q2's b meets a only at 0.4); a always wins once λ ≥ q2's (0.5 - 0.1)/(2 - 1) = 0.4
    grid = lambda_grid(P_QP, COST_P, n=6)
    assert len(grid) == 6 and grid[0] == 0.0 and grid[1] == pytest.approx(0.1) and grid[-1] == pytest.approx(0.4)
    assert np.all(np.diff(grid) > 0)
    last = sweep(P_QP, COST_P, QUALITY_QP, grid[-1:], NAMES)[0]
    assert (last.cost, last.quality) == (1.0, pytest.approx(1 / 3))
    assert lambda_grid([[0.9, 0.1]], [1.0, 2.0]) == [0.0]  # the cheapest is already the router's choice


def test_the_oracle_point() -> None:
    # q0: providers 0 and 1 tie at 0.5 → the cheaper 1 (cost 1); q1: provider 2 (0.9, cost 4)
    o = oracle_point([[0.5, 0.5, 0.2], [0.0, 0.3, 0.9]], [2.0, 1.0, 4.0])
    assert (o.name, o.cost, o.quality) == ("oracle", pytest.approx(2.5), pytest.approx(0.7))


def test_the_report_from_router_scores() -> None:
    r = frontier_report("judge", P_QP, COST_P, QUALITY_QP, NAMES, lambdas=[0.0, 0.1, 100.0],
                        baselines={"judge_oracle": (2.0, 0.9)})
    # singles: a (1, 1/3), b (2, 0.5), c (4, 0.5) → weak a, strong b (ties c at 0.5 and is cheaper)
    assert (r.weak, r.strong) == ("a", "b") and [s.name for s in r.mixing_hull] == ["a", "b"]
    # router (1, 1/3) → (4/3, 2/3) slope 1 → (7/3, 1) slope 1/3
    assert r.router_frontier == [(1.0, pytest.approx(1 / 3)), (pytest.approx(4 / 3), pytest.approx(2 / 3)),
                                 (pytest.approx(7 / 3), 1.0)]
    # over [1, 4]: 1/3 · 1/2 + 1 · 5/6 + 5/3 · 1 = 8/3, / 3
    assert r.aiq_router == pytest.approx(8 / 9)
    # over [1, 4]: 1 · (1/3 + 1/2)/2 + 2 · 1/2 = 17/12, / 3
    assert r.aiq_mixing == pytest.approx(17 / 36)
    # over [1, 2]: 1/6 + (2/3 + 8/9)/2 · 2/3 = 37/54; PGR gap 1/6: (37/54 - 18/54) · 6 = 19/9 (above strong: > 1)
    assert r.apgr == pytest.approx(19 / 9)
    # targets 1/3 + 1/12 and 1/3 + 2/15 on the first slope 1
    assert (r.cpt50, r.cpt80) == (pytest.approx(13 / 12), pytest.approx(17 / 15))
    assert (r.cpt50_share, r.cpt80_share) == (pytest.approx(13 / 24), pytest.approx(17 / 30))
    assert [(b.name, b.cost, b.quality) for b in r.baselines] == [
        ("judge_oracle", 2.0, 0.9), ("oracle", pytest.approx(7 / 3), pytest.approx(1.0))]
    text = render(r)
    assert "AIQ router 0.8889 vs mixing 0.4722" in text and "APGR 2.111" in text


def test_plot_writes_a_png(tmp_path) -> None:
    judge = frontier_report("judge", P_QP, COST_P, QUALITY_QP, NAMES,
                            baselines={"per_domain_best": (2.0, 0.7), "judge_oracle": (2.0, 0.9)})
    human = build_report("human", _router((1, 0.8), (3, 0.8)), [NamedPoint(name="x", cost=1, quality=0.8)])
    path = plot([judge, human], tmp_path / "out" / "frontier.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
