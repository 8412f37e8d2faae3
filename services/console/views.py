"""What each page shows, computed from the store and the files (the templates only lay it out)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from schemas.calibration import Review
from schemas.cycle import ENDS, CycleRecord
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.ndcg import format_ordering
from services.providers.human import QrelsStore, human_grades


@dataclass(frozen=True)
class VerdictView:
    """One verdict, un-blinded, with the reviews people left on it."""

    verdict: Verdict
    judge_key: str
    ordering: str
    grades: dict[str, int]
    reviews: list[Review]


def trace_page(trace: Trace, verdicts: list[tuple[Verdict, str]], reviews: list[Review],
               qrels: QrelsStore) -> dict[str, Any]:
    """The trace page: candidates side by side (citations cited by several providers marked), signals, the
    judge's verdicts with their reviews, the humans' nDCG@10 where the query has qrels, the routed decision."""
    cited = Counter(c.url for cand in trace.candidates for c in {x.url: x for x in cand.citations}.values())
    shared = {url for url, n in cited.items() if n > 1}
    by_verdict: dict[str, list[Review]] = {}
    for r in reviews:
        by_verdict.setdefault(r.verdict_id, []).append(r)
    human = None
    try:
        h = human_grades(trace, qrels)
        human = None if h is None else {"collection": h.collection, "query_id": h.query_id,
                                        "ndcg": h.ndcg, "ordering": format_ordering(h.ordering)}
    except (OSError, ValueError):  # the collection's files are not on this machine
        human = None
    views = [VerdictView(v, key, format_ordering(v.ordering), {g.provider: g.grade for g in v.grades},
                         by_verdict.get(v.verdict_id, [])) for v, key in verdicts]
    return {"trace": trace, "shared": shared, "cited": cited, "verdicts": views, "human": human,
            "providers": [c.provider for c in trace.candidates],
            "overlaps": sorted(trace.signals.pairwise_overlap.items())}


def eval_page(doc: dict[str, Any], decision: dict[str, Any] | None) -> dict[str, Any]:
    """The evaluation page: each policy's row, the paired comparisons, the label ceiling per collection,
    the decision and the rules that made it, and per measure the cost–quality plane's figures."""
    policies = []
    for name, p in (doc.get("policies") or {}).items():
        if isinstance(p, dict):
            policies.append({"name": name, "adapter": p.get("adapter"), "human": (p.get("human") or {}).get("mean"),
                             "judge": (p.get("judge") or {}).get("mean"), "cost": p.get("cost_per_query_usd"),
                             "router_p50": p.get("router_p50_ms"), "router_p99": p.get("router_p99_ms"),
                             "queries": p.get("queries"), "fallbacks": sum((p.get("fallbacks") or {}).values())})
    planes = []
    for measure, f in (doc.get("frontier") or {}).items():
        if not isinstance(f, dict):
            continue
        points = {b["name"]: (b["cost"], b["quality"]) for b in f.get("baselines", []) if "cost" in b}
        points.update({s["name"]: (s["cost"], s["quality"]) for s in f.get("singles", []) if "cost" in s})
        for p in policies:
            if p["name"] in ("candidate", "deployed", "linear") and p.get(measure) is not None and p["cost"]:
                points[p["name"]] = (p["cost"], p[measure])
        planes.append({"measure": measure, "points": points,
                       "curve": [tuple(x) for x in f.get("router_frontier", [])],
                       "hull": [(h["cost"], h["quality"]) for h in f.get("mixing_hull", [])],
                       "figures": {k: f.get(k) for k in ("aiq_router", "aiq_mixing", "apgr", "cpt50", "cpt80",
                                                         "weak", "strong")}})
    return {"inputs": doc.get("inputs") or {}, "policies": policies, "comparisons": doc.get("comparisons") or [],
            "collections": doc.get("collections") or [], "dev_halves": _rows(doc.get("dev_halves"), "human"),
            "planes": planes, "decision": decision}


def _rows(value: Any, needs: str) -> list[dict[str, Any]]:
    """The rows of a list field that are objects with a ``needs`` object (a hand-edited report shows what it can)."""
    return [r for r in value if isinstance(r, dict) and isinstance(r.get(needs), dict)] if isinstance(value, list) else []


def adapters_page(events: list[Any], promoted: dict[str, tuple[int, str | None] | None],
                  serving: dict[str, dict[str, int]], stamps: dict[str, int]) -> list[dict[str, Any]]:
    """One row per (model, version): hashes, when published, when promoted, whether it is promoted now and
    which samplers serve it (from the publisher's Redis keys when they answer)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e.published_at):
        row = rows.setdefault((e.model_id, e.version), {
            "model_id": e.model_id, "version": e.version, "base_model": e.base_model, "files": e.files_sha256,
            "published_at": e.published_at, "promoted_at": None, "metrics": e.metrics, "url": e.url})
        if e.promoted:
            row["promoted_at"] = e.published_at
            row["fallback_provider"] = e.fallback_provider
    out = []
    for (model, version), row in sorted(rows.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        now = promoted.get(model)
        row["promoted_now"] = now is not None and now[0] == version
        row["serving"] = sorted(s for s, v in (serving.get(model) or {}).items() if v == version)
        row["stamp"] = stamps.get(model)
        out.append(row)
    return out


CARRIED = ("episodes", "new_episodes", "adapter_in", "adapter_out", "decision", "drift")


def cycles_page(cycles: list[list[CycleRecord]]) -> list[dict[str, Any]]:
    """One row per cycle: where it stands (its last phase, or running), what went in and came out, the
    decision and its reasons, the drift that may have called it, each phase's time."""
    rows = []
    for records in cycles:
        first, last = records[0], records[-1]
        carried: dict[str, Any] = {}
        for r in records:  # later phases carry what earlier ones knew; a field set once stays set
            carried.update({k: getattr(r, k) for k in CARRIED if getattr(r, k) is not None})
        latest = list(reversed(records))
        rows.append({
            "cycle_id": first.cycle_id, "model_id": first.model_id, "kind": first.kind, "slot": first.slot,
            "trigger": first.trigger, "code_version": first.code_version,
            "state": last.phase if last.phase in ENDS else "running",
            "phases": [(r.phase, r.at) for r in records],
            "reasons": next((r.reasons for r in latest if r.reasons), ()),
            "reason": next((r.reason for r in latest if r.reason), ""),
            "figures": dict(sorted({k: v for r in records for k, v in r.figures.items()}.items())),
            "timings": last.timings_s, "total_s": (last.at - first.at).total_seconds(),
            **{k: carried.get(k) for k in CARRIED}})
    return rows
