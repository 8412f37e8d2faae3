"""How much of the demo's held-out figure is its training draw: the demo's recipe retrained with other seeds.

The demo trains its student once (``--passes`` chained one-pass SFT runs, pass k seeded k, the pass
published chosen by routing on the trainer's own eval episodes) and reports one held-out figure. Training
is seeded (LoRA init, data order, dropout), so another seed is another draw of the same recipe. This
retrains that recipe on the demo's own training episodes with seed offsets 0..N-1 (offset s seeds pass k
with ``1000·s + k``; offset 0 is the demo's draw, and its adapter's sha256 is checked against the demo's),
asks each chosen adapter about the held-out queries the way the gateway asks (the demo's decision and
λ through that training set's label → top-tier table), and reports per draw: nDCG@10 against the human
qrels, cost, the gain over the best single provider and over the linear router (seeded paired bootstrap),
then the mean and spread over draws and how many meet issue 23's target (≥ +20 % at ≤ 45 % of its cost).

Nothing is chosen here: the demo keeps its seed, whatever this shows; the held-out queries only count.

    python bench/seed_spread.py --demo-dir out/demo --seeds 5

Writes bench/results/seed_spread.json and seed_spread.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.tools.demo import DemoOptions  # noqa: E402
from services.tools.demo_loop import LoopOptions  # noqa: E402

DEMO = LoopOptions()
#: Issue 23's "done when" figures: gain over the best single provider, and the share of its cost.
TARGET_GAIN, TARGET_COST = 0.20, 0.45


def pass_seed(offset: int, k: int) -> int:
    """The trainer's seed for pass ``k`` (0-based) of draw ``offset``; offset 0 is the demo's own seeds."""
    return 1000 * offset + k


def adapter_sha(adapter: Path) -> str:
    """sha256 of the adapter's weights file (what the publisher stamps)."""
    from services.common.adapter_files import sha256_file

    return sha256_file(adapter / "adapter_model.safetensors")


def meets(row: dict[str, Any]) -> bool:
    """Whether a draw meets issue 23's quality lines: ≥ +20 % over best single at ≤ 45 % of its cost, and
    the paired interval of its difference to the linear router above 0."""
    ci = row["vs_linear"]["ci95"]
    return (row["gain_pct"] >= 100 * TARGET_GAIN and row["cost_share"] <= TARGET_COST
            and ci is not None and ci[0] > 0)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample SD, min and max."""
    return {"mean": round(statistics.fmean(values), 4),
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo-dir", type=Path, required=True, help="a finished `fanroute demo` output directory")
    ap.add_argument("--seeds", type=int, default=5, help="draws: seed offsets 0..N-1 (0 is the demo's own)")
    ap.add_argument("--passes", type=int, default=DemoOptions().passes,
                    help="chained passes per draw (the demo's: 3)")
    ap.add_argument("--resamples", type=int, default=2000, help="paired bootstrap resamples")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/fanroute-seed-spread"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/seed_spread.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the draws already in --out (same demo folder and passes) and train the rest")
    args = ap.parse_args(argv)
    if not 1 <= args.seeds <= 50:
        ap.error(f"--seeds must be within 1..50 (got {args.seeds})")
    if not 1 <= args.passes <= 5:
        ap.error(f"--passes must be within 1..5, as the demo's (got {args.passes})")
    train_file = args.demo_dir / "train" / "episodes.jsonl"
    for f in (train_file, args.demo_dir / "eval" / "traces.jsonl", args.demo_dir / "eval" / "eval.json"):
        if not f.is_file():
            ap.error(f"--demo-dir: {f} is missing (run `fanroute demo` first)")
    return run(args, train_file)


def run(args: argparse.Namespace, train_file: Path) -> int:
    """Train every draw, evaluate it and the demo's own adapter, write the JSON and the plot."""
    from bench.data_scaling import held_out_episodes
    from bench.routed_eval import Queries, gateway_picks, tokenizer_and_base
    from services.evaluate.baseline import choose_best_single
    from services.evaluate.inputs import held_out, load_traces_file
    from services.router.rates import top_tier_rates
    from services.trainer.data import load_episodes_file
    from services.trainer.settings import TrainerSettings

    episodes = load_episodes_file(train_file)
    traces = {t.trace_id: t for t in load_traces_file(args.demo_dir / "eval" / "traces.jsonl")}
    trained = {ep.trace_id for ep in episodes}
    held = [t for t in held_out(traces.values(), episodes).traces if t.trace_id not in trained]
    base_model = TrainerSettings().base_model
    tok, base, pad_id = tokenizer_and_base(base_model)
    q = Queries(held_out_episodes(held, []), traces, tok)
    cost = {c.provider: c.cost_usd for t in traces.values() for c in t.candidates}
    rates = top_tier_rates(episodes)  # the linear router's, as `fanroute eval` fits it on every training episode
    best = choose_best_single(episodes).provider
    best_picks = {ep.episode_id: best for ep in q.episodes}
    linear = gateway_picks(q.linear_probs(episodes), cost, DEMO.cost_weight, rates)
    ref = {"best_single": {"provider": best, **q.qrels_summary(best_picks, cost)},
           "linear": q.qrels_summary(linear, cost)}
    demo_eval = json.loads((args.demo_dir / "eval" / "eval.json").read_text())
    print(f"{len(episodes)} training episodes, {len(held)} held-out traces ({len(q.human)} with qrels); "
          f"best single {best} {ref['best_single']['ndcg10']:.4f}, linear {ref['linear']['ndcg10']:.4f}", flush=True)

    def row_of(picks: dict[str, str]) -> dict[str, Any]:
        s = q.qrels_summary(picks, cost)
        return {**s, "gain_pct": round(100 * (s["ndcg10"] / ref["best_single"]["ndcg10"] - 1), 2),
                "cost_share": round(s["cost"] / ref["best_single"]["cost"], 4),
                "vs_best_single": compare(q, picks, best_picks, args.resamples),
                "vs_linear": compare(q, picks, linear, args.resamples)}

    demo_adapter = args.demo_dir / "train" / "run" / "adapter"
    result: dict[str, Any] = {
        "demo_dir": str(args.demo_dir), "passes": args.passes, "decision": DEMO.decision,
        "cost_weight": DEMO.cost_weight, "held_out_with_qrels": len(q.human), **ref,
        "demo": {"adapter_sha256": adapter_sha(demo_adapter),
                 "eval_json_student": candidate_ndcg(demo_eval),
                 **row_of(lm_picks(q, demo_adapter, base, pad_id, cost))},
        "draws": kept_draws(args)}
    print(f"the demo's adapter here: {result['demo']['ndcg10']:.4f} (its eval.json: "
          f"{result['demo']['eval_json_student']})", flush=True)
    for s in range(len(result["draws"]), args.seeds):
        t0 = time.perf_counter()
        adapter, passes = train_draw(s, args, train_file, base_model, cost)
        row = {"offset": s, "seeds": [pass_seed(s, k) for k in range(len(passes))], "passes": passes,
               "adapter_sha256": adapter_sha(adapter), "train_s": round(time.perf_counter() - t0, 1),
               **row_of(lm_picks(q, adapter, base, pad_id, cost))}
        row["meets_target"] = meets(row)
        result["draws"].append(row)
        print(f"draw {s}: nDCG@10 {row['ndcg10']:.4f} ({row['gain_pct']:+.1f} % over {best}, "
              f"{100 * row['cost_share']:.0f} % of its cost), vs linear {row['vs_linear']['mean_diff']:+.4f} "
              f"{row['vs_linear']['ci95']}; sha {row['adapter_sha256'][:8]}; {row['train_s']:.0f} s", flush=True)
        result["summary"] = summary(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))
    return 0


def lm_picks(q: Any, adapter: Path, base: Path, pad_id: int, cost: dict[str, float]) -> dict[str, str]:
    """An adapter's picks as the gateway makes them: its probabilities through its *own* label → top-tier table
    (``top_tier_rates.json``, written by the trainer from the episodes it trained on) at the demo's λ."""
    from bench.routed_eval import gateway_picks
    from services.common.adapter_files import RATES_FILE
    from services.router.rates import from_json

    rates = from_json(json.loads((adapter / RATES_FILE).read_text()))
    return gateway_picks(q.adapter_probs(adapter, base, pad_id), cost, DEMO.cost_weight, rates)


def kept_draws(args: argparse.Namespace) -> list[dict[str, Any]]:
    """With ``--resume``, the draws of an earlier run of the same demo folder and passes; else none."""
    if not args.resume or not args.out.is_file():
        return []
    old = json.loads(args.out.read_text())
    if old.get("demo_dir") != str(args.demo_dir) or old.get("passes") != args.passes:
        raise SystemExit(f"--resume: {args.out} holds another run ({old.get('demo_dir')}, {old.get('passes')} passes)")
    return list(old.get("draws") or [])[:args.seeds]


def candidate_ndcg(report: dict[str, Any]) -> float | None:
    """The candidate's held-out nDCG@10 in a ``fanroute eval`` report."""
    row = (report.get("policies") or {}).get("candidate") or {}
    return (row.get("human") or {}).get("mean")


def compare(q: Any, a: dict[str, str], b: dict[str, str], resamples: int) -> dict[str, Any]:
    """``a − b`` nDCG@10 over the held-out queries with qrels: mean, seeded paired bootstrap interval, and
    wins/ties/losses (``services.evaluate.metrics.paired``)."""
    from services.evaluate.metrics import paired
    from services.evaluate.policies import Outcome

    def outcomes(picks: dict[str, str]) -> list[Outcome]:
        return [Outcome(policy="p", called=(picks[ep.episode_id],), returned=picks[ep.episode_id], cost_usd=0.0,
                        latency_ms=0.0, human=q.human[ep.trace_id].get(picks[ep.episode_id], 0.0), judge=None)
                for ep in q.episodes if q.human.get(ep.trace_id)]
    p = paired("a", "b", "human", outcomes(a), outcomes(b), resamples=resamples)
    return {"mean_diff": p.mean_diff, "ci95": list(p.ci95) if p.ci95 else None,
            "wins": p.wins, "ties": p.ties, "losses": p.losses}


def train_draw(offset: int, args: argparse.Namespace, train_file: Path, base_model: str,
               cost: dict[str, float]) -> tuple[Path, list[dict]]:
    """The demo's chained passes with this draw's seeds, the pass chosen as the demo chooses it; returns the
    chosen adapter and each pass's utility on the trainer's eval episodes."""
    from services.tools.demo_loop import (
        chosen_pass,
        one_query,
        pass_utility,
        stop_after,
    )
    from services.trainer.settings import TrainerSettings
    from services.trainer.train import train

    costs = ",".join(f"{k}={v:g}" for k, v in sorted(cost.items()))  # as the demo's gateway priced them
    utilities: list[float | None] = []
    adapters: list[Path] = []
    init = None
    for k in range(args.passes):
        out = args.work_dir / f"draw{offset}" / f"pass{k + 1}"
        shutil.rmtree(out, ignore_errors=True)
        run = train(TrainerSettings(base_model=base_model, episodes_file=train_file, output_dir=out,
                                    allow_uncalibrated=True, seed=pass_seed(offset, k), init_adapter=init,
                                    max_steps=DEMO.max_steps, batch_size=DEMO.batch_size, eval_fraction=0.1,
                                    eval_every=0, eval_max_examples=40, checkpoint_every=0, publisher_url=None,
                                    route_cost_weight=DEMO.cost_weight, route_costs=costs),
                    out=lambda line: None)
        init = run.adapter_dir
        adapters.append(run.adapter_dir)
        utilities.append(pass_utility(run.final_metrics, DEMO.cost_weight))
        if DEMO.select_pass == "route" and stop_after(utilities, DEMO.min_passes, one_query(run.final_metrics)):
            break
    pick = chosen_pass(utilities) if DEMO.select_pass == "route" else len(adapters) - 1
    return adapters[pick], [{"pass": i + 1, "utility": u, "chosen": i == pick} for i, u in enumerate(utilities)]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Mean and spread over the draws, and how many meet the target."""
    draws = result["draws"]
    return {"draws": len(draws), "ndcg10": spread([d["ndcg10"] for d in draws]),
            "gain_pct": spread([d["gain_pct"] for d in draws]),
            "cost_share": spread([d["cost_share"] for d in draws]),
            "vs_linear": spread([d["vs_linear"]["mean_diff"] for d in draws]),
            "meet_target": sum(d["meets_target"] for d in draws),
            "offset0_is_the_demos_adapter": bool(draws) and draws[0]["adapter_sha256"] == result["demo"]["adapter_sha256"]}


def plot(result: dict[str, Any], path: Path) -> None:
    """Each draw's held-out nDCG@10 beside the best single provider, the +20 % line and the linear router."""
    from bench.routed_eval import finish, new_axes

    fig, ax = new_axes((6.5, 4))
    draws = result["draws"]
    ax.plot([d["offset"] for d in draws], [d["ndcg10"] for d in draws], "o", label="LM student, one draw each")
    ax.set_xticks([d["offset"] for d in draws])
    best = result["best_single"]["ndcg10"]
    ax.axhline(best, linestyle="--", color="grey", label=f"best single ({result['best_single']['provider']})")
    ax.axhline(best * (1 + TARGET_GAIN), linestyle=":", color="red", label="+20 % over best single (issue 23)")
    ax.axhline(result["linear"]["ndcg10"], linestyle="-.", color="green", label="linear router (same episodes)")
    finish(fig, ax, path, xlabel="seed offset (0 = the demo's draw)", ylabel="held-out nDCG@10 (human qrels)",
           title="The demo's recipe, retrained with other seeds")


if __name__ == "__main__":
    raise SystemExit(main())
