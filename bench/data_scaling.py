"""The data-scaling curve: held-out routed nDCG@10 (human qrels) against training episodes, for the LM
student and the linear router trained on the same episodes.

Input: the output of the large-traffic recipe, ``fanroute demo --synthetic N --no-loop --out DIR``:
``DIR/train/episodes.jsonl`` (the development queries' training split and every synthetic query's
episode, all judged by the same judge) and ``DIR/eval/traces.jsonl`` (the held-out development
queries' traces, which only ever count here). Each size trains on every development training episode
plus the first synthetic ones (a fixed seeded order), ``--passes`` chained one-pass SFT runs (the
demo's recipe). Both routers decide as the demo's gateway does (``--decision``, ``--cost-weight``: by
default the top-tier decision through that size's own label → top-tier table, λ = 150, each
provider's cost from the traces; :func:`bench.routed_eval.gateway_picks`); rounds before 2026-12-07
picked the most probable name (λ = 0). Beside them, per size: the best single provider chosen on that
size's episodes. Nothing is tuned here: the recipe and the decision are the demo's, chosen on the
training split's own validation queries (``bench/sft_recipes.py``, ``bench/decision_rules.py``).

    fanroute demo --synthetic 3600 --no-loop --out out/demo-traffic
    python bench/data_scaling.py --run-dir out/demo-traffic --sizes 450,1000,2000,4000

Writes bench/results/data_scaling.json and data_scaling.png.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.tools.demo_loop import LoopOptions  # noqa: E402

DEMO = LoopOptions()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="fanroute demo --synthetic N --no-loop --out DIR")
    ap.add_argument("--sizes", default="450,1000,2000,4000", help="training episodes per point (capped by what exists)")
    ap.add_argument("--passes", type=int, default=1, help="chained one-pass SFT runs per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decision", choices=("top-tier", "first-choice"), default=DEMO.decision,
                    help="how both routers decide, as the gateway does (default: the demo's)")
    ap.add_argument("--cost-weight", type=float, default=DEMO.cost_weight,
                    help="λ, quality per USD, of both routers' decisions (default: the demo's)")
    ap.add_argument("--no-lm", action="store_true", help="the linear router only (minutes instead of an hour)")
    ap.add_argument("--base-model", default=None, help="base model (default: the trainer's)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/fanroute-data-scaling"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/data_scaling.json")
    args = ap.parse_args(argv)
    if not 0 <= args.cost_weight <= 1e6:
        ap.error(f"--cost-weight must be within 0..1e6, as the gateway's routing.cost_weight (got {args.cost_weight})")
    if args.passes < 1:
        ap.error(f"--passes must be at least 1 (got {args.passes})")

    from bench.routed_eval import Queries, gateway_picks, tokenizer_and_base
    from services.common.dataset import write_jsonl
    from services.evaluate.baseline import choose_best_single
    from services.evaluate.inputs import held_out, load_traces_file
    from services.router.rates import top_tier_rates
    from services.tools.traffic import is_synthetic
    from services.trainer.data import load_episodes_file
    from services.trainer.settings import TrainerSettings
    from services.trainer.train import train

    episodes = load_episodes_file(args.run_dir / "train" / "episodes.jsonl")
    traces = {t.trace_id: t for t in load_traces_file(args.run_dir / "eval" / "traces.jsonl")}
    qid = {t.trace_id: t.query_id for t in traces.values()}
    trained = {ep.trace_id for ep in episodes}
    dev = [ep for ep in episodes if not is_synthetic(qid.get(ep.trace_id))]
    synth = [ep for ep in episodes if is_synthetic(qid.get(ep.trace_id))]
    random.Random(args.seed).shuffle(synth)
    # the evaluation's own rule (services.evaluate.inputs.held_out): a trace whose query text any training
    # episode has (the same question in two collections) is not held out
    held = [t for t in held_out(traces.values(), episodes).traces if t.trace_id not in trained]
    base_model = args.base_model or TrainerSettings().base_model
    tok, base, pad_id = tokenizer_and_base(base_model)
    held_eps = held_out_episodes(held, dev)
    q = Queries(held_eps, traces, tok)
    cost = {c.provider: c.cost_usd for t in traces.values() for c in t.candidates}

    def routed(probs: dict[str, dict[str, float]], subset: list[Any]) -> dict[str, Any]:
        """A router's row, its picks made as the gateway makes them (the decision, λ, the providers' costs)."""
        rates = top_tier_rates(subset) if args.decision == "top-tier" else None
        return priced(gateway_picks(probs, cost, args.cost_weight, rates))

    def priced(picks: dict[str, str]) -> dict[str, Any]:
        return q.qrels_summary(picks, cost)
    print(f"{len(dev)} development training episodes, {len(synth)} synthetic; {len(held)} held-out traces "
          f"({len(q.human)} with qrels)", flush=True)
    sizes = sorted({min(int(s), len(dev) + len(synth)) for s in args.sizes.split(",")})
    rows: list[dict[str, Any]] = []
    for n in sizes:
        subset = dev[:n] + synth[:max(0, n - len(dev))]
        row: dict[str, Any] = {"episodes": len(subset), "synthetic": max(0, n - len(dev))}
        t0 = time.perf_counter()
        row["linear"] = routed(q.linear_probs(subset, seed=args.seed), subset)
        row["linear_fit_s"] = round(time.perf_counter() - t0, 1)
        best = choose_best_single(subset).provider
        row["best_single"] = {"provider": best, **priced({ep.episode_id: best for ep in held_eps})}
        if not args.no_lm:
            work = args.work_dir / f"n{len(subset)}"
            init, t0 = None, time.perf_counter()
            data = write_jsonl(subset, work / "episodes.jsonl")
            for p in range(args.passes):
                shutil.rmtree(work / f"pass{p + 1}", ignore_errors=True)  # a re-run trains afresh
                run = train(TrainerSettings(base_model=base_model, episodes_file=data, output_dir=work / f"pass{p + 1}",
                                            init_adapter=init,
                                            seed=p, allow_uncalibrated=True, grades_source="ordering",
                                            eval_fraction=0.0, max_steps=100_000, checkpoint_every=0),
                            out=lambda line: None)
                init = run.adapter_dir
            row["lm_train_s"] = round(time.perf_counter() - t0, 1)
            row["lm"] = routed(q.adapter_probs(init, base, pad_id), subset)
        rows.append(row)
        lm = f"LM {row['lm']['ndcg10']:.3f} ({row['lm_train_s']:.0f} s)" if "lm" in row else "LM -"
        print(f"{row['episodes']:>6} episodes ({row['synthetic']} synthetic): {lm}, "
              f"linear {row['linear']['ndcg10']:.3f}, best single {best} {row['best_single']['ndcg10']:.3f}",
              flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"run_dir": str(args.run_dir), "passes": args.passes,
                                        "decision": args.decision, "cost_weight": args.cost_weight,
                                        "held_out": len(held),
                                        "held_out_with_qrels": len(q.human), "rows": rows}, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    return 0


def held_out_episodes(held: list[Any], dev: list[Any]) -> list[Any]:
    """Episodes to route for the held-out traces: the router prompt over each trace's providers and query,
    with an ordering-shaped answer (the label is not read: qrels grade these)."""
    from schemas.episode import ChatMessage, Episode
    from services.common.prompt import router_turns

    out = []
    for t in held:
        names = sorted(c.provider for c in t.candidates)
        system, user = router_turns(names, t.query)
        out.append(Episode(episode_id=t.trace_id, trace_id=t.trace_id, created_at=t.received_at,
                           messages=(system, user, ChatMessage(role="assistant", content=" = ".join(names))),
                           label_rule="held-out (qrels only)", rewards=(), primary_reward=None))
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from bench.routed_eval import finish, new_axes

    fig, ax = new_axes((6.5, 4))
    x = [r["episodes"] for r in rows]
    if all("lm" in r for r in rows):
        ax.plot(x, [r["lm"]["ndcg10"] for r in rows], marker="o", label="LM student (SmolLM2-135M + LoRA)")
    ax.plot(x, [r["linear"]["ndcg10"] for r in rows], marker="s", label="linear router (TF-IDF + LR)")
    ax.plot(x, [r["best_single"]["ndcg10"] for r in rows], linestyle="--", color="grey",
            label="best single provider (chosen per size)")
    ax.set_xscale("log")
    finish(fig, ax, path, xlabel="training episodes (development split + synthetic traffic)",
           ylabel="held-out nDCG@10 (human qrels)", title="Data scaling: routed quality vs judged training episodes")


if __name__ == "__main__":
    raise SystemExit(main())
