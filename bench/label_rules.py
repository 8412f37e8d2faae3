"""Which label rule names the better provider: the judge's grades alone, or its scores inside a tier too.

The label (``services/common/labels.py``) is the judge's top tier, cheapest first, then by name. The
local judge grades from a continuous score cut at three points, so inside a tier it knew more than the
grade says; this bench asks, per rule, how good the provider it names is by the humans' qrels (its
nDCG@10) and what it costs, on a demo's **training** queries only (the held-out ones are never read
unless ``--split held-out`` is asked for, after a rule is chosen).

    python bench/label_rules.py --demo-dir out/demo [--split train|held-out] [--json bench/results/label_rules.json]

Rules: ``tier-cost-name`` (the label today), ``tier-cost-score`` (the same, the judge's score before the
name), ``tier-score`` (top tier by score, cost ignored), ``score`` (the highest score, grades ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.base import decode
from schemas.episode import Episode
from services.common.labels import cost_aware
from services.common.prompt import query_of
from services.common.splits import normalise_query
from services.evaluate.inputs import load_traces_file
from services.judge.blind import blind
from services.judge.settings import build_backend, default_judge
from services.providers.human import QrelsStore, human_grades
from services.providers.markets import market

RULES = ("tier-cost-name", "tier-cost-score", "tier-score", "score")


def pick(rule: str, scores: dict[str, float], tiers: tuple[tuple[str, ...], ...], costs: dict[str, float]) -> str:
    """The provider ``rule`` names first, from the judge's per-provider scores and grade tiers."""
    if rule == "tier-cost-name":
        return cost_aware(tiers, costs)[0][0]
    if rule == "tier-cost-score":
        return min(tiers[0], key=lambda n: (costs.get(n, float("inf")), -scores[n], n))
    if rule == "tier-score":
        return min(tiers[0], key=lambda n: (-scores[n], costs.get(n, float("inf")), n))
    if rule == "score":
        return min(scores, key=lambda n: (-scores[n], costs.get(n, float("inf")), n))
    raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")


async def judged(traces) -> dict[str, tuple[dict[str, float], tuple[tuple[str, ...], ...]]]:
    """Per trace: the default judge's score and its grade tiers per provider (blind, as the worker sees it)."""
    from services.judge.backends.local import grade_of, tiers_by_grade

    backend = build_backend(default_judge())
    await backend.start()
    out = {}
    try:
        for t in traces:
            seen = blind(t, 0)
            by_letter = await asyncio.to_thread(backend.scores, seen.request)
            scores = {seen.letters[k]: v for k, v in by_letter.items()}
            for name in seen.not_shown:
                scores[name] = -1.0  # failed: graded 0 by rule, last
            grades = {n: (grade_of(s, backend.config.cut_points) if s >= 0 else -1) for n, s in scores.items()}
            out[t.trace_id] = (scores, tiers_by_grade(grades))
    finally:
        await backend.close()
    return out


async def main(args: argparse.Namespace) -> dict:
    demo = Path(args.demo_dir)
    for need in ("train/episodes.jsonl", "eval/traces.jsonl"):
        if not (demo / need).is_file():
            raise SystemExit(f"label_rules: {demo / need} does not exist (--demo-dir: a finished demo's output folder)")
    train_q = {normalise_query(query_of(decode(Episode, line)))
               for line in (demo / "train" / "episodes.jsonl").read_bytes().splitlines() if line.strip()}
    traces = [t for t in load_traces_file(demo / "eval" / "traces.jsonl") if t.mode == "fanout"]
    want_train = args.split == "train"
    traces = [t for t in traces if (normalise_query(t.query) in train_q) == want_train]
    store = QrelsStore()
    human = {t.trace_id: h for t in traces if (h := human_grades(t, store)) is not None}
    traces = [t for t in traces if t.trace_id in human]
    costs = {p.name: p.cost_usd for p in market("federated")}
    verdicts = await judged(traces)
    rows, picks = {}, {}
    for rule in RULES:
        chosen = {t.trace_id: pick(rule, *verdicts[t.trace_id], costs) for t in traces}
        picks[rule] = chosen
        ndcg = [human[k].ndcg.get(p, 0.0) for k, p in chosen.items()]
        rows[rule] = {"ndcg10": round(sum(ndcg) / len(ndcg), 4),
                      "cost_usd": round(sum(costs[p] for p in chosen.values()) / len(chosen), 6),
                      "changed_vs_today": sum(p != picks["tier-cost-name"][k] for k, p in chosen.items()),
                      "shares": dict(collections.Counter(chosen.values()).most_common())}
    best = {k: max(h.ndcg.values()) for k, h in human.items()}
    report = {"split": args.split, "queries": len(traces), "demo_dir": str(demo), "rules": rows,
              "per_query_oracle": round(sum(best.values()) / len(best), 4)}
    print(f"{args.split} split: {len(traces)} queries with qrels; per-query oracle {report['per_query_oracle']:.4f}")
    print(f"  {'rule':<16} {'nDCG@10':>8} {'$/query':>9} {'changed':>8}  shares")
    for rule, r in rows.items():
        shares = ", ".join(f"{n} {c}" for n, c in r["shares"].items())
        print(f"  {rule:<16} {r['ndcg10']:>8.4f} {r['cost_usd']:>9.6f} {r['changed_vs_today']:>8}  {shares}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="out/demo", help="a finished demo's output folder")
    p.add_argument("--split", choices=("train", "held-out"), default="train",
                   help="whose queries: the demo's training split (default) or its held-out one")
    p.add_argument("--json", default="", help="also write the figures here")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
