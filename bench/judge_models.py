"""Does a judge with a stronger embedding model give better labels? The default MiniLM judge beside another model.

For each embedding model, on one finished demo's fan-out traces (every dev query, every provider's answer):

1. the judge's weight and cut points are chosen as ``bench/judge_tune.py`` chooses them: the grid's best
   tau-b against the qrels-derived orderings on the dev queries' *tuning* half;
2. its gate figure: tau-b on the *validation* half (which chose nothing);
3. its labels (the episode builder's rule: top tier, cheapest, then name) scored against the qrels on the
   demo's *training* split, and apart on the training queries in the validation half (untouched by step 1).

The demo's held-out queries are never read. Source embeddings go through the judge's disk cache, so a
second run is fast; the first with a large model embeds ≈ 9,000 source texts.

    python bench/judge_models.py --demo-dir out/demo --model /path/to/all-mpnet-base-v2 [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.judge_tune import WEIGHTS, search, tau
from bench.label_rules import demo_inputs, label_ndcg
from bench.label_rules import parts as score_parts
from services.common.splits import dev_half, normalise_query
from services.providers.human import QrelsStore, human_grades
from services.providers.markets import market


def compare(name: str, model_path: str | None, traces, human, train_ids: set[str], costs) -> dict:
    """Steps 1-3 of the module's docstring for one model."""
    print(f"{name}: scoring {len(traces)} traces", flush=True)
    t0 = time.perf_counter()
    parts = score_parts(traces, model_path, progress=True)
    seconds = time.perf_counter() - t0
    rows = {"tune": [], "validation": []}
    for t in traces:
        names, lex, cos = parts[t.trace_id]
        rows[dev_half(t.query_id or "")].append((t.trace_id, names, lex, cos, human[t.trace_id].ordering))
    tau_tune, w, cuts = search(rows["tune"], WEIGHTS)
    labelled = {h: [(parts[t.trace_id], human[t.trace_id].ndcg) for t in traces
                    if t.trace_id in train_ids and (h == "all" or dev_half(t.query_id or "") == h)]
                for h in ("all", "validation")}
    r = {"model": name, "model_path": model_path, "scoring_seconds": round(seconds, 1), "weight": w,
         "cut_points": cuts, "tau_b_tune": round(tau_tune, 4), "tau_b_validation": round(tau(rows["validation"], w, cuts), 4),
         "train_queries": len(labelled["all"]), "labels_ndcg10_train": round(label_ndcg(labelled["all"], w, cuts, costs), 4),
         "train_validation_queries": len(labelled["validation"]),
         "labels_ndcg10_train_validation": round(label_ndcg(labelled["validation"], w, cuts, costs), 4)}
    print(f"  {name}: w={w} cuts={cuts}; tau-b tune {r['tau_b_tune']:.3f}, validation (the gate) "
          f"{r['tau_b_validation']:.3f}; labels' nDCG@10 on {r['train_queries']} training queries "
          f"{r['labels_ndcg10_train']:.4f}, on the {r['train_validation_queries']} of them in the validation half "
          f"{r['labels_ndcg10_train_validation']:.4f}; scoring took {seconds:.0f} s", flush=True)
    return r


def main(args: argparse.Namespace) -> list[dict]:
    missing = [m for m in args.model if not Path(m).is_dir()]
    if missing:
        raise SystemExit(f"judge_models: --model {missing[0]} is not a folder (a sentence-transformers model's)")
    train_q, fanout = demo_inputs(Path(args.demo_dir), "judge_models")
    store, human, traces = QrelsStore(), {}, []
    for t in fanout:
        if (h := human_grades(t, store)) is not None:
            human[t.trace_id] = h
            traces.append(t)
    train_ids = {t.trace_id for t in traces if normalise_query(t.query) in train_q}
    costs = {p.name: p.cost_usd for p in market("federated")}
    out = [compare("minilm (default)", None, traces, human, train_ids, costs)]
    out += [compare(Path(m).name, m, traces, human, train_ids, costs) for m in args.model]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="out/demo", help="a finished demo's output folder")
    p.add_argument("--model", action="append", default=[], help="a sentence-transformers model folder (repeatable)")
    p.add_argument("--json", default="", help="also write the figures here")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
