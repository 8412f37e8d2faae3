"""Which label rule names the better provider: the judge's grades alone, or its scores inside a tier too.

The label (``services/common/labels.py``) is the judge's top tier, cheapest first, then by name. The
local judge grades from a continuous score cut at three points, so inside a tier it knew more than the
grade says; this bench asks, per rule, how good the provider it names is by the humans' qrels (its
nDCG@10) and what it costs, on a demo's **training** queries only (the held-out ones are never read
unless ``--split held-out`` is asked for, after a rule is chosen).

    python bench/label_rules.py --demo-dir out/demo [--split train|held-out] [--json bench/results/label_rules.json]

Rules: ``tier-cost-name`` (the label today), ``tier-cost-score`` (the same, the judge's score before the
name), ``tier-score`` (top tier by score, cost ignored), ``score`` (the highest score, grades ignored).

``--cut-points`` also asks whether the judge's blend weight and cut points, chosen for its tau-b on the dev
queries' tuning half (``bench/judge_tune.py``), should instead be chosen for its labels' nDCG: the grid of
``judge_tune.py`` searched on one half of the training queries (by hash of the query id) and scored on the
other, both ways round (one split per ``--fold-salts`` value), beside today's settings on the same halves;
then the grid's best on the training queries in the dev queries' tuning half, scored on those in the
validation half (the judge gate reports on the validation half, so nothing is chosen there).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.judge_tune import WEIGHTS
from schemas.base import decode
from schemas.episode import Episode
from services.common.labels import cost_aware
from services.common.prompt import query_of
from services.common.splits import dev_half, normalise_query
from services.evaluate.inputs import load_traces_file
from services.judge.blind import blind
from services.judge.settings import default_judge
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


#: The blend weights of ``bench/judge_tune.py``; three increasing cut points drawn from a 0.05 grid.
CUTS = tuple(round(0.05 * i, 2) for i in range(2, 19))


def parts(traces, model_path: str | None = None,
          progress: bool = False) -> dict[str, tuple[tuple[str, ...], list[float], list[float]]]:
    """Per trace: the providers, and each one's lexical and cosine scores (-1: failed, graded 0 by rule).

    The judge is the service's default (what it reads: its ``top_sources``) with the embedding model at
    ``model_path`` (None: MiniLM); the weight and cut points are applied per call by the caller."""
    import time

    from services.judge.backends.local import LocalJudge

    judge = LocalJudge(default_judge().model_copy(update={"model_path": model_path}))
    asyncio.run(judge.start())
    out, t0 = {}, time.perf_counter()
    try:
        for n, t in enumerate(traces, 1):
            seen = blind(t, 0)
            shown = [c.sources[:judge.config.top_sources] for c in seen.request.candidates]
            names = tuple(seen.letters[c.letter] for c in seen.request.candidates) + tuple(seen.not_shown)
            pad = [-1.0] * len(seen.not_shown)
            out[t.trace_id] = (names, [*judge._lexical(seen.request.query, shown), *pad],
                               [*judge._cosine(seen.request.query, shown), *pad])
            if progress and n % 100 == 0:
                print(f"    {n}/{len(traces)} traces, {time.perf_counter() - t0:.0f} s, {judge.embedding_stats}",
                      flush=True)
    finally:
        asyncio.run(judge.close())
    return out


def verdict(names: tuple[str, ...], lex: list[float], cos: list[float], w: float,
            cuts) -> tuple[dict[str, float], tuple[tuple[str, ...], ...]]:
    """The judge's scores and grade tiers from its two parts, as the worker computes them (scores rounded to
    6 places; a failed provider, -1, scores -1 and sits in a tier of its own, last)."""
    from services.judge.backends.local import grade_of, tiers_by_grade

    scores = {n: round((1 - w) * a + w * b, 6) if a >= 0 else -1.0 for n, a, b in zip(names, lex, cos)}
    return scores, tiers_by_grade({n: grade_of(v, cuts) if v >= 0 else -1 for n, v in scores.items()})


def label_ndcg(rows, w: float, cuts, costs: dict[str, float]) -> float:
    """Mean nDCG@10 (qrels) of the provider the label names when the judge blends with ``w`` and cuts at ``cuts``."""
    total = 0.0
    for (names, lex, cos), ndcg in rows:
        total += ndcg.get(cost_aware(verdict(names, lex, cos, w, cuts)[1], costs)[0][0], 0.0)
    return total / len(rows)


def fold_of(key: str, salt: int) -> int:
    """0 or 1 by hash of the query id (salt 0: the bare id, the split of the first run)."""
    return hashlib.sha256(((f"{salt}:" if salt else "") + key).encode()).digest()[0] % 2


def cut_points_cv(scores, traces, human, costs: dict[str, float], today: tuple[float, tuple[float, ...]],
                  salts: tuple[int, ...] = (0,)) -> dict:
    """Two-fold per salt: the grid's best on each half of the queries, scored on the other, beside today's
    (``scores``: :func:`parts` of ``traces``)."""
    grid = [(w, c) for w in WEIGHTS for c in itertools.combinations(CUTS, 3)]
    out = []
    for salt in salts:
        folds: list[list] = [[], []]
        for t in traces:
            folds[fold_of(t.query_id or t.query, salt)].append((scores[t.trace_id], human[t.trace_id].ndcg))
        for k in (0, 1):
            fit, other = folds[k], folds[1 - k]
            best = max((label_ndcg(fit, w, c, costs), w, c) for w, c in grid)
            r = {"salt": salt, "fit_queries": len(fit), "other_queries": len(other), "weight": best[1],
                 "cut_points": best[2], "fit_ndcg10": round(best[0], 4),
                 "fit_ndcg10_today": round(label_ndcg(fit, *today, costs), 4),
                 "other_ndcg10": round(label_ndcg(other, best[1], best[2], costs), 4),
                 "other_ndcg10_today": round(label_ndcg(other, *today, costs), 4)}
            out.append(r)
            print(f"  salt {salt}: fitted on {r['fit_queries']} (w={r['weight']}, cuts={r['cut_points']}): "
                  f"{r['fit_ndcg10']:.4f} there (today {r['fit_ndcg10_today']:.4f}); on the other "
                  f"{r['other_queries']}: {r['other_ndcg10']:.4f} (today {r['other_ndcg10_today']:.4f})", flush=True)
    gains = [r["other_ndcg10"] - r["other_ndcg10_today"] for r in out]
    print(f"  out-of-fold gain over today's settings: mean {sum(gains) / len(gains):+.4f}, "
          f"{sum(g > 0 for g in gains)} of {len(gains)} above 0", flush=True)
    # the setting to adopt is chosen on the training queries of the dev queries' tuning half only: the
    # validation half is the judge gate's honest figure (and the held-out queries were never read here)
    half = {h: [(scores[t.trace_id], human[t.trace_id].ndcg) for t in traces if dev_half(t.query_id or "") == h]
            for h in ("tune", "validation")}
    best = max((label_ndcg(half["tune"], w, c, costs), w, c) for w, c in grid)
    chosen = {"weight": best[1], "cut_points": best[2], "tune_queries": len(half["tune"]),
              "tune_ndcg10": round(best[0], 4), "tune_ndcg10_today": round(label_ndcg(half["tune"], *today, costs), 4),
              "validation_queries": len(half["validation"]),
              "validation_ndcg10": round(label_ndcg(half["validation"], best[1], best[2], costs), 4),
              "validation_ndcg10_today": round(label_ndcg(half["validation"], *today, costs), 4)}
    print(f"  chosen on the {chosen['tune_queries']} training queries in the dev tuning half: w={best[1]}, "
          f"cuts={best[2]}: {chosen['tune_ndcg10']:.4f} (today {chosen['tune_ndcg10_today']:.4f}); on the "
          f"{chosen['validation_queries']} in the validation half: {chosen['validation_ndcg10']:.4f} "
          f"(today {chosen['validation_ndcg10_today']:.4f})", flush=True)
    return {"today": {"weight": today[0], "cut_points": today[1]}, "folds": out,
            "out_of_fold_gain_mean": round(sum(gains) / len(gains), 4),
            "out_of_fold_gains_above_0": sum(g > 0 for g in gains), "chosen": chosen}


def demo_inputs(demo: Path, bench: str) -> tuple[set[str], list]:
    """(the training episodes' normalised queries, every fan-out trace) of a finished demo; exit naming a missing file."""
    for need in ("train/episodes.jsonl", "eval/traces.jsonl"):
        if not (demo / need).is_file():
            raise SystemExit(f"{bench}: {demo / need} does not exist (--demo-dir: a finished demo's output folder)")
    train_q = {normalise_query(query_of(decode(Episode, line)))
               for line in (demo / "train" / "episodes.jsonl").read_bytes().splitlines() if line.strip()}
    return train_q, [t for t in load_traces_file(demo / "eval" / "traces.jsonl") if t.mode == "fanout"]


async def main(args: argparse.Namespace) -> dict:
    demo = Path(args.demo_dir)
    train_q, traces = demo_inputs(demo, "label_rules")
    want_train = args.split == "train"
    traces = [t for t in traces if (normalise_query(t.query) in train_q) == want_train]
    store = QrelsStore()
    human = {t.trace_id: h for t in traces if (h := human_grades(t, store)) is not None}
    traces = [t for t in traces if t.trace_id in human]
    costs = {p.name: p.cost_usd for p in market("federated")}
    judge = default_judge()
    today = (judge.embedding_weight, tuple(judge.cut_points))
    scores = await asyncio.to_thread(parts, traces)
    verdicts = {k: verdict(*v, *today) for k, v in scores.items()}
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
    if args.cut_points:
        print("the judge's weight and cut points chosen for its labels' nDCG, two-fold over these queries:")
        report["cut_points"] = await asyncio.to_thread(cut_points_cv, scores, traces, human, costs, today,
                                                       args.fold_salts)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def salts(value: str) -> tuple[int, ...]:
    """``--fold-salts``: comma-separated integers, at least one."""
    try:
        out = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of integers (e.g. 0,1,2)") from None
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="out/demo", help="a finished demo's output folder")
    p.add_argument("--split", choices=("train", "held-out"), default="train",
                   help="whose queries: the demo's training split (default) or its held-out one")
    p.add_argument("--cut-points", action="store_true",
                   help="also choose the judge's weight and cut points for its labels' nDCG, two-fold")
    p.add_argument("--fold-salts", type=salts, default=(0,),
                   help="with --cut-points: one two-fold split per salt (comma-separated integers)")
    p.add_argument("--json", default="", help="also write the figures here")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
