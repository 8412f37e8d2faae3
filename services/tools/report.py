"""Score traces against the collections' human qrels: per provider and per routing policy.

Policies over the same traces: each single provider, the oracle (best provider per query, in
hindsight) and full fan-out with the RRF-fused list. Quality is nDCG@10 of the results returned,
against human relevance judgments nobody here wrote.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas.trace import Trace
from services.common.ir import ndcg_at_k
from services.providers.collections import load_qrels, parse_doc_url
from services.providers.config import ALL_COLLECTIONS
from services.providers.fusion import rrf


@dataclass(frozen=True)
class PolicyRow:
    """One line of the report."""

    policy: str
    ndcg10: float
    calls_per_query: float
    cost_per_query_usd: float
    latency_p50_ms: float
    error_rate: float


def _doc_ids(urls: list[str], collection: str) -> list[str]:
    """Ranked ids for scoring against ``collection``'s qrels.

    A result from another collection (or the web) keeps its rank but can never match a judged
    id: doc ids are only unique within a collection.
    """
    out = []
    for u in urls:
        ref = parse_doc_url(u) if u.startswith("collection://") else None
        out.append(ref.doc_id if ref is not None and ref.collection == collection else f"\0{u}")
    return out


def score_traces(traces: list[Trace], collections_dir: Path) -> list[PolicyRow]:
    """Rows for each provider, the oracle and fan-out, over traces whose query_id has qrels."""
    qrels_cache: dict[str, dict[str, dict[str, int]]] = {}
    per_provider: dict[str, list[tuple[float, float, float, bool]]] = defaultdict(list)
    oracle, fused, fan_lat, fan_cost = [], [], [], []
    for t in traces:
        if not t.query_id or "/" not in t.query_id:
            continue
        coll, qid = t.query_id.split("/", 1)
        if coll not in ALL_COLLECTIONS:
            continue
        if coll not in qrels_cache:
            qrels_cache[coll] = load_qrels(collections_dir, coll)
        judged = qrels_cache[coll].get(qid)
        if not judged:
            continue
        scores = []
        for c in t.candidates:
            s = ndcg_at_k(_doc_ids([x.url for x in c.citations], coll), judged) if c.ok else 0.0
            per_provider[c.provider].append((s, c.latency_ms, c.cost_usd, not c.ok))
            scores.append(s)
        oracle.append(max(scores))
        fused.append(ndcg_at_k(_doc_ids([f.url for f in rrf(t.candidates)], coll), judged))
        fan_lat.append(max(c.latency_ms for c in t.candidates))
        fan_cost.append(sum(c.cost_usd for c in t.candidates))
    rows = [PolicyRow(p, *_agg(v)) for p, v in sorted(per_provider.items())]
    n_providers = len(per_provider)
    if oracle:
        best = max(rows, key=lambda r: r.ndcg10)
        rows.append(PolicyRow("oracle (best per query)", float(np.mean(oracle)), 1.0, float("nan"),
                              float("nan"), 0.0))
        rows.append(PolicyRow("fan-out (RRF fused)", float(np.mean(fused)), float(n_providers),
                              float(np.mean(fan_cost)), float(np.median(fan_lat)), 0.0))
        rows.append(PolicyRow(f"best single ({best.policy})", best.ndcg10, 1.0, best.cost_per_query_usd,
                              best.latency_p50_ms, best.error_rate))
    return rows


def _agg(v: list[tuple[float, float, float, bool]]) -> tuple[float, float, float, float, float]:
    a = np.asarray(v, dtype=float)
    return float(a[:, 0].mean()), 1.0, float(a[:, 2].mean()), float(np.median(a[:, 1])), float(a[:, 3].mean())


def render(rows: list[PolicyRow], n_queries: int) -> str:
    """A plain-text table."""
    head = f"{'policy':<34} {'nDCG@10':>8} {'calls/q':>8} {'cost/q $':>9} {'p50 ms':>8} {'errors':>7}"
    lines = [f"human-qrels quality over {n_queries} judged queries", head, "-" * len(head)]
    for r in rows:
        cost = "-" if np.isnan(r.cost_per_query_usd) else f"{r.cost_per_query_usd:.4f}"
        lat = "-" if np.isnan(r.latency_p50_ms) else f"{r.latency_p50_ms:.0f}"
        lines.append(f"{r.policy:<34} {r.ndcg10:>8.3f} {r.calls_per_query:>8.1f} {cost:>9} {lat:>8} "
                     f"{r.error_rate:>7.1%}")
    return "\n".join(lines)


def write_report(rows: list[PolicyRow], out_dir: Path) -> tuple[Path, Path]:
    """``report.json`` and ``cost_quality.png`` (every policy on the cost–quality plane)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / "report.json"
    jpath.write_text(json.dumps([r.__dict__ for r in rows], indent=2, default=float) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # "best single" is the same point as that provider's own row
    plot_cost_quality(ax, [(r.policy, r.cost_per_query_usd, r.ndcg10) for r in rows
                           if not r.policy.startswith("best single")], "nDCG@10 vs human qrels")
    ax.set_title("fanroute: cost–quality of providers and policies")
    fig.tight_layout()
    ppath = out_dir / "cost_quality.png"
    fig.savefig(ppath, dpi=120)
    plt.close(fig)
    return jpath, ppath


def plot_cost_quality(ax, points: Sequence[tuple[str, float, float]], ylabel: str) -> None:
    """Policies on one cost–quality axes: (label, cost per query, quality) each a labelled point;
    a NaN cost (a policy with no meaningful cost, e.g. the oracle) is a dashed horizontal line."""
    stacked: dict[tuple[float, float], int] = defaultdict(int)  # labels of coinciding points stack up
    for label, cost, quality in points:
        spot = (round(float(cost), 9), round(float(quality), 6))
        dy = 3 + 10 * stacked[spot]
        stacked[spot] += 1
        if np.isnan(cost):
            ax.axhline(quality, ls="--", c="grey", lw=1)
            ax.annotate(label, (0.01, quality), xycoords=("axes fraction", "data"), xytext=(0, dy),
                        textcoords="offset points", fontsize=8, color="grey")
            continue
        ax.scatter(cost, quality, s=40)
        ax.annotate(label, (cost, quality), xytext=(4, dy), textcoords="offset points", fontsize=8)
    ax.set_xlabel("provider cost per query (USD)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
