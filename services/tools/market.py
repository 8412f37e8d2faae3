"""``fanroute market``: is there anything for a router to win in a provider market?

Fans every judged development query out to a market's providers in-process (no bus, no simulated
latency), scores each answer against the collections' human qrels, and prints, per market: each
provider; the best single provider; the best provider per domain (a perfect domain router); the
per-query oracle; and the judge-oracle (per query the default judge's first provider, cost-aware:
the most a student distilled from that judge can reach). nDCG@10 and cost per query, on all dev
queries and on the *validation half* with every choice (best single, per-domain picks) made on the
tuning half only — the split the verticals' settings and the judge's cut points were tuned on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from schemas.trace import Trace
from services.common.splits import dev_half
from services.judge.calibration.human import QrelsStore, human_grades, split_query_id
from services.providers.markets import MARKETS, domain_of, market

#: The issue's targets for a market where routing can pay (ratios to the best single provider).
TARGET_DOMAIN_GAIN, TARGET_ORACLE_GAIN = 1.10, 1.20


@dataclass(frozen=True)
class QueryRow:
    """One dev query: its domain, split, each provider's nDCG@10, cost, and the judge's first tier."""

    query_id: str
    domain: str
    half: str
    ndcg: dict[str, float]
    cost: dict[str, float]
    judge_top: tuple[str, ...] | None


@dataclass(frozen=True)
class Row:
    """One line of the market table."""

    policy: str
    ndcg: float
    cost_usd: float
    picks: dict[str, str] = field(default_factory=dict)
    key: str = ""  # stable name of the row ("best single", "oracle", ...); the provider's for a provider row

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.policy)


def cheapest(names: Sequence[str], cost: Mapping[str, float]) -> str:
    """The cheapest of ``names`` (then by name): equal quality is worth the lower price."""
    return min(names, key=lambda n: (cost[n], n))


def best_of(values: Mapping[str, float], cost: Mapping[str, float]) -> str:
    """The provider with the highest value; ties go to the cheapest."""
    top = max(values.values())
    return cheapest([n for n, v in values.items() if v >= top - 1e-12], cost)


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def table(rows: Sequence[QueryRow], choose_on: Sequence[QueryRow]) -> list[Row]:
    """The market table over ``rows``, with best single and per-domain picks chosen on ``choose_on``."""
    providers = list(rows[0].ndcg)
    cost = rows[0].cost
    mean_on = lambda qs, p: _mean([q.ndcg[p] for q in qs])  # noqa: E731
    out = [Row(p, mean_on(rows, p), cost[p]) for p in providers]
    single = best_of({p: mean_on(choose_on, p) for p in providers}, cost)
    out.append(Row(f"best single ({single})", mean_on(rows, single), cost[single], {"*": single}, "best single"))
    picks = {}
    for d in sorted({q.domain for q in choose_on}):
        qs = [q for q in choose_on if q.domain == d]
        picks[d] = best_of({p: mean_on(qs, p) for p in providers}, cost)
    routed = [q for q in rows if q.domain in picks]
    out.append(Row("per-domain best", _mean([q.ndcg[picks[q.domain]] for q in routed]),
                   _mean([cost[picks[q.domain]] for q in routed]), picks))
    oracle = [best_of(q.ndcg, cost) for q in rows]
    out.append(Row("oracle (best per query)", _mean([q.ndcg[p] for q, p in zip(rows, oracle)]),
                   _mean([cost[p] for p in oracle]), key="oracle"))
    judged = [q for q in rows if q.judge_top]
    if judged:
        jpick = [cheapest(q.judge_top, cost) for q in judged]
        out.append(Row("judge-oracle (judge's first, cost-aware)", _mean([q.ndcg[p] for q, p in zip(judged, jpick)]),
                       _mean([cost[p] for p in jpick]), key="judge-oracle"))
    return out


def targets(rows: Sequence[Row]) -> dict[str, float | bool]:
    """The three figures a routable market must reach, from one table."""
    by = {r.key: r for r in rows}
    single, domain, oracle = by["best single"], by["per-domain best"], by["oracle"]
    return {"per_domain_over_single": domain.ndcg / single.ndcg, "oracle_over_single": oracle.ndcg / single.ndcg,
            "cheapest_routing_cost_usd": min(domain.cost_usd, oracle.cost_usd), "best_single_cost_usd": single.cost_usd,
            "met": bool(domain.ndcg >= TARGET_DOMAIN_GAIN * single.ndcg and oracle.ndcg >= TARGET_ORACLE_GAIN * single.ndcg
                        and min(domain.cost_usd, oracle.cost_usd) < single.cost_usd)}


def render(title: str, all_rows: Sequence[Row], val_rows: Sequence[Row]) -> str:
    """Both tables side by side: all dev queries, and the validation half (choices on the tuning half)."""
    val = {r.key: r for r in val_rows}
    lines = [title, f"{'policy':<44} {'nDCG@10 all':>11} {'val half':>9} {'cost/q $':>9}", "-" * 77]
    for r in all_rows:
        v = val.get(r.key)
        vtxt = f"{v.ndcg:.3f}" if v is not None else "-"
        lines.append(f"{r.policy:<44} {r.ndcg:>11.3f} {vtxt:>9} {r.cost_usd:>9.4f}")
    picks = next(r.picks for r in all_rows if r.key == "per-domain best")
    lines.append("per-domain picks (all): " + ", ".join(f"{d}->{p}" for d, p in picks.items()))
    for name, rows in (("all dev queries", all_rows), ("validation half", val_rows)):
        t = targets(rows)
        lines.append(f"{name}: per-domain / best single {t['per_domain_over_single']:.2f}x "
                     f"(target >= {TARGET_DOMAIN_GAIN:.2f}), oracle / best single {t['oracle_over_single']:.2f}x "
                     f"(>= {TARGET_ORACLE_GAIN:.2f}), cheapest routing ${t['cheapest_routing_cost_usd']:.4f} vs best "
                     f"single ${t['best_single_cost_usd']:.4f} -> {'MET' if t['met'] else 'NOT MET'}")
    return "\n".join(lines)


def query_rows(traces: Sequence[Trace], judge_tiers: Mapping[str, Sequence[Sequence[str]]] | None,
               store: QrelsStore | None = None) -> list[QueryRow]:
    """Per-query nDCG, cost and the judge's top tier of each trace that has human grades."""
    store = store or QrelsStore()
    out = []
    for t in traces:
        human = human_grades(t, store)
        ref = split_query_id(t.query_id)
        if human is None or ref is None:
            continue
        tiers = judge_tiers.get(t.trace_id) if judge_tiers is not None else None
        out.append(QueryRow(query_id=t.query_id or "", domain=domain_of(ref[0]), half=dev_half(t.query_id or ""),
                            ndcg=dict(human.ndcg), cost={c.provider: c.cost_usd for c in t.candidates},
                            judge_top=tuple(tiers[0]) if tiers else None))
    return out


async def measure(name: str, *, limit: int | None, with_judge: bool) -> tuple[list[QueryRow], str | None]:
    """Fan out ``name``'s market, judge it with the default judge (unless refused), and return the rows."""
    from services.common.errors import ConfigError
    from services.judge import calibrate as cal
    from services.judge.settings import JudgeSettings, build_backend

    providers = market(name)  # type: ignore[arg-type]
    traces = await cal.offline_traces(providers, n=limit, seed=0, contested_threshold=0.1)
    tiers, judge_note = None, None
    if with_judge:
        from services.judge.guard import guard
        from services.judge.settings_local import LocalJudgeConfig

        settings = JudgeSettings(market=name)
        try:
            guard(settings)
        except ConfigError as exc:  # e.g. nested: its dense providers embed with the judge's MiniLM
            settings = JudgeSettings(market=name, judge=LocalJudgeConfig())
            guard(settings)
            judge_note = f"the default judge is refused here ({exc}); the lexical local judge instead"
        backend = build_backend(settings.judge)
        await backend.start()
        try:
            tiers = await cal.judge_tiers(backend, traces)
        finally:
            await backend.close()
        judge_note = f"judge {backend.identity.model}" + (f" — {judge_note}" if judge_note else "")
    return query_rows(traces, tiers), judge_note


def run(args: argparse.Namespace) -> int:
    """Print and write the table of each market; 0 when every market was measured."""
    from services.common.errors import FanrouteError

    names = MARKETS if args.market == "all" else (args.market,)
    report = {}
    for name in names:
        try:
            rows, note = asyncio.run(measure(name, limit=args.queries, with_judge=not args.no_judge))
        except FanrouteError as exc:  # e.g. a collections folder that is not there
            print(f"fanroute market {name}: {exc}", file=sys.stderr)
            return 2
        if not rows:
            print(f"fanroute market {name}: no dev query with qrels was fanned out", file=sys.stderr)
            return 2
        tune = [q for q in rows if q.half == "tune"]
        val = [q for q in rows if q.half == "validation"]
        all_rows, val_rows = table(rows, rows), table(val, tune)
        print(render(f"\nmarket {name!r}: {len(rows)} dev queries ({len(tune)} tuning, {len(val)} validation); "
                     f"{note or 'no judge'}", all_rows, val_rows), flush=True)
        report[name] = {"judge": note, "all": [asdict(r) for r in all_rows], "validation": [asdict(r) for r in val_rows],
                        "targets": {"all": targets(all_rows), "validation": targets(val_rows)}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "market.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path} and {plot(report, args.out)}")
    return 0


def plot(report: Mapping[str, Mapping], out_dir: Path) -> Path:
    """One cost–quality panel per market (all dev queries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.tools.report import plot_cost_quality

    fig, axes = plt.subplots(1, len(report), figsize=(6.5 * len(report), 4.5), squeeze=False)
    for ax, (name, rep) in zip(axes[0], report.items()):
        plot_cost_quality(ax, [(r["policy"], r["cost_usd"], r["ndcg"]) for r in rep["all"]
                               if not r["policy"].startswith("best single")], "nDCG@10 vs human qrels")
        ax.set_title(f"market {name!r}")
    fig.tight_layout()
    path = out_dir / "market.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
