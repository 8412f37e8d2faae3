"""Decision rules compared by cross-validation on the TRAINING split only — never on the held-out queries.

A router's probabilities say which provider is the judge's cost-aware first choice (its label). What the
gateway does with them is a decision rule: ``first-choice`` (expected quality = P(label)) or ``top-tier``
(expected quality = P(in the judge's top tier) = Σ_l P(l | q) · rate[l][p], the table counted from the
training folds: services/router/rates.py), minus λ · cost. This fits the linear router on k − 1 folds of
the training episodes (folds by query), decides on the k-th with every rule and λ, and reports, over all
folds, the judge's grade of the choice (the demo's judge, run here on the same traces), nDCG@10 against
the human qrels and the cost per query; beside them ``web-lexical``-style best single (chosen on the
training folds) and the judge-oracle. The LM student uses the same rule on its own probabilities; it is
not retrained per fold here (minutes per fold on CPU), so the rule and λ are chosen with the linear
router's probabilities — a stated proxy.

    python bench/decision_rules.py --run-dir out/demo

Writes bench/results/decision_rules.json and a PNG of judge grade and nDCG against cost.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAMBDAS = (0.0, 50.0, 100.0, 150.0, 200.0, 250.0, 300.0, 400.0)
RULES = ("first-choice", "top-tier")


def fold_of(ep: Any, k: int) -> int:
    """The fold of an episode: a hash of its query, so one query's episodes stay together."""
    from services.common.prompt import query_of

    return int(hashlib.sha256(query_of(ep).encode()).hexdigest()[:8], 16) % k


def judge_grades(traces: Sequence[Any], market: str) -> dict[str, dict[str, int]]:
    """trace id → provider → the demo's judge grade (the default judge backend, as ``fanroute eval`` runs it)."""
    from services.common.settings import KafkaSettings, RedisSettings
    from services.evaluate.scoring import judge_all
    from services.judge.guard import provider_hosts
    from services.judge.settings import JudgeSettings, build_backend
    from services.providers.markets import market as providers_of_market

    settings = JudgeSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                             providers=providers_of_market(market))

    async def run() -> dict[str, dict[str, int]]:
        backend = build_backend(settings.judge)
        await backend.start()
        try:
            return await judge_all(backend, traces, hide=provider_hosts(settings), progress=True)
        finally:
            await backend.close()

    return {k: v for k, v in asyncio.run(run()).items() if v}


def decide(probs: Mapping[str, float], cost: Mapping[str, float], lam: float, rates: Any) -> str:
    from services.router.scoring import utilities
    from services.router.rates import expected_top_tier

    quality = dict(probs) if rates is None else expected_top_tier(probs, rates)
    util = utilities(quality, cost, lam)
    return min(util, key=lambda n: (-util[n], cost.get(n, 0.0), n))


def evaluate(episodes: Sequence[Any], traces: Mapping[str, Any], grades: Mapping[str, Mapping[str, int]],
             human: Mapping[str, Mapping[str, float]], k: int, seed: int) -> dict[str, Any]:
    """Every rule × λ, best single and the judge-oracle, pooled over the ``k`` folds."""
    from services.common.prompt import providers_of, query_of
    from services.evaluate.baseline import choose_best_single
    from services.router.linear import first_choice, fit
    from services.router.rates import top_tier_rates
    from services.router.scoring import probabilities

    picks: dict[str, dict[str, str]] = {}
    for f in range(k):
        train = [ep for ep in episodes if fold_of(ep, k) != f]
        test = [ep for ep in episodes if fold_of(ep, k) == f]
        router, rates = fit(train, seed=seed), top_tier_rates(train)
        best = choose_best_single(train).provider
        for ep in test:
            tr = traces[ep.trace_id]
            cost = {c.provider: c.cost_usd for c in tr.candidates}
            probs = probabilities(router.scores(query_of(ep), providers_of(ep)))
            picks.setdefault("best single", {})[ep.trace_id] = best
            picks.setdefault("judge-oracle (the label)", {})[ep.trace_id] = first_choice(ep)
            for rule in RULES:
                for lam in LAMBDAS:
                    picks.setdefault(f"{rule} λ={lam:g}", {})[ep.trace_id] = decide(
                        probs, cost, lam, rates if rule == "top-tier" else None)
    rows = []
    for name, chosen in picks.items():
        ids = [t for t in chosen if t in grades]
        rated = [t for t in ids if human.get(t)]
        cost = [next(c.cost_usd for c in traces[t].candidates if c.provider == chosen[t]) for t in ids]
        rule, _, lam = name.partition(" λ=")
        rows.append({"policy": name, "rule": rule if lam else None, "lambda": float(lam) if lam else None,
                     "judge_grade": sum(grades[t].get(chosen[t], 0) for t in ids) / max(len(ids), 1),
                     "ndcg10": sum(human[t].get(chosen[t], 0.0) for t in rated) / max(len(rated), 1),
                     "cost_per_query_usd": sum(cost) / max(len(cost), 1), "n": len(ids), "n_qrels": len(rated)})
    return {"folds": k, "episodes": len(episodes), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True,
                    help="A demo's output (out/demo): its training split's episodes and traces are read")
    ap.add_argument("--market", default="federated", help="The demo's market (its providers are the judge's)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/decision_rules.json")
    args = ap.parse_args(argv)
    if args.folds < 2:
        ap.error("--folds must be at least 2")

    from services.evaluate.inputs import load_traces_file
    from services.evaluate.scoring import human_scores
    from services.judge.calibration.human import QrelsStore
    from services.trainer.data import load_episodes_file

    train_file, traces_file = args.run_dir / "train" / "episodes.jsonl", args.run_dir / "eval" / "traces.jsonl"
    for path in (train_file, traces_file):
        if not path.is_file():
            ap.error(f"{path} is missing: --run-dir must be a finished demo's output directory (out/demo)")
    episodes = load_episodes_file(train_file)  # the training split: the held-out traces are never read below
    traces = {t.trace_id: t for t in load_traces_file(traces_file)}
    episodes = [ep for ep in episodes if ep.trace_id in traces]
    trained = [traces[ep.trace_id] for ep in episodes]
    print(f"{len(episodes)} training episodes; judging their traces ({args.market} market)", flush=True)
    grades = judge_grades(trained, args.market)
    store = QrelsStore()
    human = {t.trace_id: h for t in trained if (h := human_scores(t, store))}
    report = evaluate(episodes, traces, grades, human, args.folds, args.seed)
    report |= {"split": "training only", "run_dir": str(args.run_dir), "market": args.market}
    for r in report["rows"]:
        print(f"{r['policy']:<28} judge {r['judge_grade']:.3f}  nDCG@10 {r['ndcg10']:.3f}  "
              f"${r['cost_per_query_usd'] * 1000:.3f}m / query", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report["rows"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Judge grade and nDCG@10 against cost per query: one curve per rule over λ, the baselines as points."""
    from bench.routed_eval import new_axes

    fig, axes = new_axes((10, 4))
    fig.clf()
    for i, (key, label) in enumerate((("judge_grade", "judge grade of the choice"), ("ndcg10", "nDCG@10 (qrels)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for rule in RULES:
            pts = sorted((r["cost_per_query_usd"] * 1000, r[key], r["lambda"]) for r in rows if r["rule"] == rule)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rule)
            for x, y, lam in pts:
                ax.annotate(f"{lam:g}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        for r, color in zip([r for r in rows if r["rule"] is None], ("black", "grey", "silver"), strict=False):
            ax.scatter([r["cost_per_query_usd"] * 1000], [r[key]], marker="s", color=color, label=r["policy"])
        ax.set_xlabel("cost per query (USD × 1000)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("decision rules over λ (the numbers), cross-validated on the training split, linear router")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
