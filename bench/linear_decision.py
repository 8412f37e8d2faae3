"""Benchmark: one linear-router decision, scikit-learn's pipeline against the compiled scorer, same run.

The gateway asks the linear router once per routed request, on its event loop. This fits the router on
an episodes file (as ``fanroute eval`` does), then times ``pipeline.predict_proba([query])`` and
:class:`services.router.linear.CompiledScorer` on the same queries, alternating, and checks that the
two give the same probabilities.

    python bench/linear_decision.py --episodes out/demo/train/episodes.jsonl \\
        --queries-file out/demo/eval/eval.json

Writes bench/results/linear_decision.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pct(values: list[float]) -> dict[str, float]:
    import numpy as np

    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "mean_ms": float(np.mean(values))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from bench.sampler_support import load_queries
    from services.router import linear
    from services.trainer.data import load_episodes_file

    t0 = time.perf_counter()
    router = linear.fit(load_episodes_file(args.episodes), seed=0)
    fit_s = time.perf_counter() - t0
    compiled = linear.CompiledScorer(router.pipeline)
    queries = load_queries(args.queries_file)
    worst = max(float(np.abs(compiled.proba(q) - router.pipeline.predict_proba([q])[0]).max()) for q in queries)
    times: dict[str, list[float]] = {"pipeline": [], "compiled": []}
    for _ in range(args.rounds):
        for q in queries:
            for name, fn in (("pipeline", lambda q: router.pipeline.predict_proba([q])), ("compiled", compiled.proba)):
                t = time.perf_counter()
                fn(q)
                times[name].append((time.perf_counter() - t) * 1000.0)
    out = {"episodes": str(args.episodes), "queries": str(args.queries_file), "n_queries": len(queries),
           "rounds": args.rounds, "fit_s": fit_s, "classes": list(router.classes), "C": router.c,
           "features": sum(len(f[1]) for f in compiled._features), "max_abs_proba_diff": worst,
           "loadavg": os.getloadavg(), **{k: pct(v) for k, v in times.items()}}
    out["ratio_pipeline_over_compiled"] = {q: out["pipeline"][q] / out["compiled"][q] for q in ("p50_ms", "p99_ms")}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=Path, required=True, help="training episodes JSONL (the router's labels)")
    p.add_argument("--queries-file", type=Path, required=True,
                   help="an eval.json (its held-out queries) or a traces/episodes JSONL")
    p.add_argument("--rounds", type=int, default=5, help="times over the queries")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "linear_decision.json")
    args = p.parse_args(argv)
    for path in (args.episodes, args.queries_file):
        if not path.is_file():
            p.error(f"{path}: no such file")
    out = run(args)
    print(f"linear router decision, {out['n_queries']} queries x {out['rounds']}, {out['features']} features: "
          f"pipeline p50 {out['pipeline']['p50_ms']:.3f} ms / p99 {out['pipeline']['p99_ms']:.3f}, compiled "
          f"p50 {out['compiled']['p50_ms']:.3f} / p99 {out['compiled']['p99_ms']:.3f} "
          f"({out['ratio_pipeline_over_compiled']['p50_ms']:.1f}x at p50); "
          f"largest probability difference {out['max_abs_proba_diff']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
