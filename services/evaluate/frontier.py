"""The cost–quality plane: a router's λ sweep, the single providers and their mixing hull, RouterBench's
AIQ and RouteLLM's APGR/CPT (pure numpy; ``fanroute eval`` feeds it one measure at a time).

Edge cases, chosen once here. Rows with a NaN quality (no qrels for the query) leave every mean, cost
included, so all points of a measure stand over the same queries. Ties (router choice, oracle pick, weak,
strong) go to the cheaper provider, then the name. R̃, the frontier of a point set, is its non-decreasing
upper convex hull (mixing two points with probability t gives the chord): from the cheapest point (the
best at that cost) to the best point (the cheapest at that quality), flat right of it (more spending buys
no quality). Left of its cheapest point a router's R̃ would be undefined, so the router's points are
joined by the cheapest single provider's (a policy anyone can mix in; a sweep to :func:`lambda_grid`'s top
reaches it anyway; no router is cheaper). A cost range starting left of that is clipped and reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from services.evaluate.metrics import TIE_EPS

#: y-axis labels of the plot, by measure.
MEASURE_LABELS = {"human": "nDCG@10 vs human qrels", "judge": "judge grade (0-3)"}
#: Plot markers of the named baselines (others get a square).
MARKERS = {"per_domain_best": "^", "judge_oracle": "D", "oracle": "*"}


class Point(BaseModel):
    """One λ of a router sweep: mean cost per query (USD) and mean realised quality."""

    model_config = ConfigDict(frozen=True)
    lam: float
    cost: float
    quality: float


class NamedPoint(BaseModel):
    """A named policy on the plane (a single provider or a baseline such as the oracle)."""

    model_config = ConfigDict(frozen=True)
    name: str
    cost: float
    quality: float


class FrontierReport(BaseModel):
    """One measure's cost–quality figures, ready for ``eval.json``."""

    model_config = ConfigDict(frozen=True)
    measure: str
    router: list[Point] = Field(description="The λ sweep, in the order swept")
    router_frontier: list[tuple[float, float]] = Field(
        description="Vertices (cost, quality) of the router's non-decreasing hull, anchored at the weak provider")
    singles: list[NamedPoint]
    mixing_hull: list[NamedPoint] = Field(description="Vertices of the single providers' non-decreasing hull")
    baselines: list[NamedPoint] = Field(default_factory=list)
    cost_range: tuple[float, float] = Field(description="The [c_min, c_max] the AIQs integrate over")
    aiq_router: float
    aiq_mixing: float
    weak: str = Field(description="The cheapest single provider (ties: the better, then the name)")
    strong: str = Field(description="The best single provider (ties: the cheaper, then the name)")
    apgr: float | None = None
    cpt50: float | None = Field(default=None, description="USD per query to reach PGR 0.5 (None: never)")
    cpt80: float | None = Field(default=None, description="USD per query to reach PGR 0.8 (None: never)")
    cpt50_share: float | None = Field(default=None, description="cpt50 / the strong provider's cost")
    cpt80_share: float | None = Field(default=None, description="cpt80 / the strong provider's cost")
    gap_note: str | None = Field(default=None, description="Why APGR and CPT are None")


def _arrays(quality_QP, cost_P, *more_QP) -> tuple[np.ndarray, ...]:
    """Float arrays with the rows whose quality has a NaN dropped, so every mean is over the same queries."""
    quality_QP, cost_P = np.asarray(quality_QP, dtype=float), np.asarray(cost_P, dtype=float)
    if quality_QP.ndim != 2 or quality_QP.shape[1] != cost_P.shape[0] or (cost_P < 0).any():
        raise ValueError(f"quality must be (queries, providers) and cost (providers,) >= 0: got "
                         f"{quality_QP.shape} and {cost_P.shape}")
    keep_Q = ~np.isnan(quality_QP).any(axis=1)
    if not keep_Q.any():
        raise ValueError("no query has this measure for every provider")
    more_QP = tuple(np.asarray(x_QP, dtype=float) for x_QP in more_QP)
    if any(x_QP.shape != quality_QP.shape for x_QP in more_QP):
        raise ValueError(f"scores and quality {quality_QP.shape} differ in shape")
    return (quality_QP[keep_Q], cost_P, *(x_QP[keep_Q] for x_QP in more_QP))


def _pick(score_QP: np.ndarray, cost_P: np.ndarray, names: Sequence[str] | None) -> np.ndarray:
    """Per query the provider with the highest score; ties (within TIE_EPS) to the cheaper, then the name."""
    order_P = np.array(sorted(range(len(cost_P)), key=lambda p: (cost_P[p], names[p] if names else p)))
    tied_QP = score_QP[:, order_P] >= score_QP.max(axis=1, keepdims=True) - TIE_EPS
    return order_P[tied_QP.argmax(axis=1)]


def sweep(P_QP, cost_P, quality_QP, lambdas: Sequence[float],
          names: Sequence[str] | None = None) -> list[Point]:
    """Per λ, choose argmax_p P[q,p] − λ·c[p] per query, then mean cost and quality of the choices."""
    quality_QP, cost_P, P_QP = _arrays(quality_QP, cost_P, P_QP)
    rows_Q = np.arange(len(quality_QP))
    out = []
    for lam in lambdas:
        if lam < 0:
            raise ValueError(f"λ must be >= 0, got {lam}")
        pick_Q = _pick(P_QP - lam * cost_P, cost_P, names)
        out.append(Point(lam=float(lam), cost=float(cost_P[pick_Q].mean()),
                         quality=float(quality_QP[rows_Q, pick_Q].mean())))
    return out


def lambda_grid(P_QP, cost_P, n: int = 25) -> list[float]:
    """0, then a log grid from the first λ that changes a choice to the one where the cheapest always wins."""
    P_QP, cost_P = np.asarray(P_QP, dtype=float), np.asarray(cost_P, dtype=float)
    pick_Q = _pick(P_QP, cost_P, None)
    # a cheaper p overtakes the λ = 0 choice once λ ≥ (P_choice − P_p) / (c_choice − c_p)
    dc_QP = cost_P[pick_Q][:, None] - cost_P[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        first_QP = np.where(dc_QP > 0, (P_QP[np.arange(len(P_QP)), pick_Q][:, None] - P_QP) / dc_QP, np.inf)
    cheap_P = cost_P <= cost_P.min()
    # the cheapest (its best-scored provider) beats p once λ ≥ (P_p − P_cheapest) / (c_p − c_cheapest)
    need_QP = (P_QP - P_QP[:, cheap_P].max(axis=1, keepdims=True)) / np.where(cheap_P, np.inf, cost_P - cost_P.min())
    if not (hi := float(need_QP.max())) > 0:
        return [0.0]
    lo = float(first_QP[first_QP > 0].min())
    return [0.0] + [float(x) for x in np.geomspace(lo, hi * (1 + 1e-9), max(n - 1, 1))]


def single_points(quality_QP, cost_P, names: Sequence[str]) -> list[NamedPoint]:
    """Each provider always called: (its cost, its mean quality)."""
    quality_QP, cost_P = _arrays(quality_QP, cost_P)
    return [NamedPoint(name=n, cost=float(c), quality=float(q))
            for n, c, q in zip(names, cost_P, quality_QP.mean(axis=0))]


def oracle_point(quality_QP, cost_P, names: Sequence[str] | None = None) -> NamedPoint:
    """Per query the best-quality provider (ties: cheaper, then name): the ceiling of any one-call router."""
    quality_QP, cost_P = _arrays(quality_QP, cost_P)
    pick_Q = _pick(quality_QP, cost_P, names)
    return NamedPoint(name="oracle", cost=float(cost_P[pick_Q].mean()),
                      quality=float(quality_QP[np.arange(len(pick_Q)), pick_Q].mean()))


def hull_indices(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-decreasing upper convex hull's vertices, cheapest first (dominated points drop out)."""
    if not points:
        raise ValueError("no points")
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best = max(points[i][1] for i in order)
    end = next(k for k, i in enumerate(order) if points[i][1] >= best - TIE_EPS)
    hull: list[int] = []
    for i in order[:end + 1]:
        if hull and points[i][0] == points[hull[-1]][0]:
            continue  # same cost, not better (sorted best first)
        while len(hull) >= 2:
            (x0, y0), (x1, y1), (x2, y2) = points[hull[-2]], points[hull[-1]], points[i]
            if (x1 - x0) * (y2 - y0) - (y1 - y0) * (x2 - x0) < -TIE_EPS:
                break  # a right turn: hull[-1] stays above the chord
            hull.pop()
        hull.append(i)
    return hull


def upper_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The vertices (cost, quality) of R̃: quality as a non-decreasing concave function of cost."""
    return [(float(points[i][0]), float(points[i][1])) for i in hull_indices(points)]


def _at(frontier: Sequence[tuple[float, float]], cost: np.ndarray) -> np.ndarray:
    """R̃ at ``cost``: linear between vertices, flat right of the last one."""
    return np.interp(cost, [c for c, _ in frontier], [q for _, q in frontier])


def aiq(frontier: Sequence[tuple[float, float]], cost_range: tuple[float, float]) -> float:
    """(1/(c_max − c_min)) ∫ R̃(c) dc over the range (RouterBench's AIQ); R̃(c_min) for an empty range."""
    lo, hi = cost_range
    if hi < lo or lo < frontier[0][0] - TIE_EPS:
        raise ValueError(f"cost range {cost_range} is reversed or starts left of the frontier at {frontier[0][0]}")
    if hi - lo <= TIE_EPS:
        return float(_at(frontier, np.array([lo]))[0])
    x = np.array(sorted({lo, hi, *(c for c, _ in frontier if lo < c < hi)}))
    y = _at(frontier, x)
    return float(((y[1:] + y[:-1]) / 2 * np.diff(x)).sum() / (hi - lo))


def cost_to_reach(frontier: Sequence[tuple[float, float]], target: float) -> float | None:
    """The least cost at which R̃ reaches ``target`` (None: never)."""
    (c0, q0), *rest = frontier
    if q0 >= target - TIE_EPS:
        return c0
    for c1, q1 in rest:
        if q1 >= target - TIE_EPS:
            return c0 + (c1 - c0) * (target - q0) / (q1 - q0)
        c0, q0 = c1, q1
    return None


def weak_strong(singles: Sequence[NamedPoint]) -> tuple[NamedPoint, NamedPoint]:
    """(weak, strong): the cheapest provider (ties: better, then name) and the best (ties: cheaper, then name)."""
    weak = min(singles, key=lambda s: (s.cost, -s.quality, s.name))
    strong = min(singles, key=lambda s: (-s.quality, s.cost, s.name))
    return weak, strong


def build_report(measure: str, router: Sequence[Point], singles: Sequence[NamedPoint],
                 baselines: Sequence[NamedPoint] = (),
                 cost_range: tuple[float, float] | None = None) -> FrontierReport:
    """AIQ of the router and of mixing, APGR and CPT over the given points (see the module's conventions).

    APGR mirrors RouteLLM's average PGR over the share of strong-model calls, with cost per query in
    its place: the mean of PGR(R̃(c)) = (R̃(c) − q_weak)/(q_strong − q_weak) over c in [c_weak, c_strong]
    (not clipped: a router above the strong provider scores PGR > 1). CPT(x) is the least cost at which
    R̃ reaches PGR x. With no quality gap (the cheapest provider is also the best) both are None.
    """
    weak, strong = weak_strong(singles)
    frontier = upper_frontier([(weak.cost, weak.quality)] + [(p.cost, p.quality) for p in router])
    mix = [singles[i] for i in hull_indices([(s.cost, s.quality) for s in singles])]
    lo, hi = cost_range or (weak.cost, max(s.cost for s in singles))
    used = (max(lo, weak.cost), max(hi, weak.cost))
    gap = strong.quality - weak.quality
    figures: dict = {}
    if gap > TIE_EPS:
        cpt = {x: cost_to_reach(frontier, weak.quality + x * gap) for x in (0.5, 0.8)}
        figures = {"apgr": (aiq(frontier, (weak.cost, strong.cost)) - weak.quality) / gap,
                   "cpt50": cpt[0.5], "cpt80": cpt[0.8],
                   "cpt50_share": None if cpt[0.5] is None else cpt[0.5] / strong.cost,
                   "cpt80_share": None if cpt[0.8] is None else cpt[0.8] / strong.cost}
    else:
        figures["gap_note"] = (f"no quality gap: the cheapest provider {weak.name} is as good as the best "
                               f"{strong.name} ({weak.quality:.4g}), so PGR is undefined")
    return FrontierReport(measure=measure, router=list(router), router_frontier=frontier, singles=list(singles),
                          mixing_hull=mix, baselines=list(baselines), cost_range=used,
                          aiq_router=aiq(frontier, used), aiq_mixing=aiq([(s.cost, s.quality) for s in mix], used),
                          weak=weak.name, strong=strong.name, **figures)


def frontier_report(measure: str, P_QP, cost_P, quality_QP, names: Sequence[str], *,
                    lambdas: Sequence[float] | None = None, baselines: Mapping[str, tuple[float, float]] | None = None,
                    cost_range: tuple[float, float] | None = None) -> FrontierReport:
    """The λ sweep of router scores ``P_QP`` (default grid: :func:`lambda_grid`), the singles and the oracle."""
    points = sweep(P_QP, cost_P, quality_QP, lambda_grid(P_QP, cost_P) if lambdas is None else lambdas, names)
    named = [NamedPoint(name=k, cost=c, quality=q) for k, (c, q) in (baselines or {}).items()]
    if "oracle" not in (baselines or {}):
        named.append(oracle_point(quality_QP, cost_P, names))
    return build_report(measure, points, single_points(quality_QP, cost_P, names), named, cost_range)


def render(report: FrontierReport) -> str:
    """A small table: the sweep, then AIQ (router vs mixing), APGR and CPT."""
    r, num = report, (lambda v, fmt: "-" if v is None else format(v, fmt))
    lines = [(f"{r.measure}: cost-quality over [{r.cost_range[0]:.4g}, {r.cost_range[1]:.4g}] USD/query; "
              f"weak {r.weak}, strong {r.strong}"), f"{'λ':>10} {'cost/q $':>10} {'quality':>8}"]
    shown = [p for i, p in enumerate(r.router) if i == 0 or (p.cost, p.quality) != (r.router[i - 1].cost,
                                                                                   r.router[i - 1].quality)]
    lines += [f"{p.lam:>10.4g} {p.cost:>10.5f} {p.quality:>8.3f}" for p in shown]  # a repeat: the λ it starts at
    lines += [f"{'':>10} {s.cost:>10.5f} {s.quality:>8.3f}  {s.name}" for s in (*r.singles, *r.baselines)]
    lines.append(f"AIQ router {r.aiq_router:.4f} vs mixing {r.aiq_mixing:.4f} ({r.aiq_router - r.aiq_mixing:+.4f})")
    if r.gap_note:
        lines.append(f"APGR, CPT: - ({r.gap_note})")
    else:
        lines.append(f"APGR {r.apgr:.3f}; CPT(50%) {num(r.cpt50, '.5f')} $ ({num(r.cpt50_share, '.0%')} of "
                     f"{r.strong}); CPT(80%) {num(r.cpt80, '.5f')} $ ({num(r.cpt80_share, '.0%')})")
    return "\n".join(lines)


def _curve(ax, frontier: Sequence[tuple[float, float]], right: float, **style) -> None:
    """A frontier as a line, extended flat to ``right``."""
    xs = [c for c, _ in frontier] + ([right] if right > frontier[-1][0] else [])
    ax.plot(xs, _at(frontier, np.array(xs)), **style)


def plot(reports: Sequence[FrontierReport], path: Path) -> Path:
    """A PNG, one panel per measure: the router's sweep and hull (λ on a few points), singles, mixing, baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.tools.report import plot_cost_quality

    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 4.8), squeeze=False)
    for ax, r in zip(axes[0], reports):
        right = max(r.cost_range[1], *(p.cost for p in (*r.router, *r.singles, *r.baselines)))
        plot_cost_quality(ax, [(s.name, s.cost, s.quality) for s in r.singles],
                          MEASURE_LABELS.get(r.measure, r.measure))
        _curve(ax, [(s.cost, s.quality) for s in r.mixing_hull], right, ls="--", c="grey",
               label=f"random mixing (AIQ {r.aiq_mixing:.3f})")
        _curve(ax, r.router_frontier, right, c="C3", lw=2, label=f"router frontier (AIQ {r.aiq_router:.3f})")
        ax.plot([p.cost for p in r.router], [p.quality for p in r.router], "o:", c="C3", ms=3, label="router λ sweep")
        for p in r.router[::max(1, len(r.router) // 4)]:
            ax.annotate(f"λ={p.lam:.3g}", (p.cost, p.quality), xytext=(4, -10), textcoords="offset points",
                        fontsize=7, color="C3")
        for b in r.baselines:
            ax.scatter(b.cost, b.quality, marker=MARKERS.get(b.name, "s"), s=70, c="k", zorder=3)
            ax.annotate(b.name, (b.cost, b.quality), xytext=(4, 4), textcoords="offset points", fontsize=8)
        apgr = "-" if r.apgr is None else f"{r.apgr:.3f}"
        ax.set_title(f"{r.measure}: APGR {apgr} (weak {r.weak}, strong {r.strong})", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
