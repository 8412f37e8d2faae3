"""Recipe: OPSD from the demo's SFT adapter on the demo's episodes, against a CPU sampler process.

Why: the one run that shows the run kind working end to end on the real model: the teacher–student
KL per step, the train–inference mismatch, and held-out nDCG before and after, drawn as a PNG. The
sampler runs as its own process (``python -m services.sampler``, no Kafka) and the trainer loads each
step's adapter into it directly; the held-out split is the SFT run's (same eval_fraction and hash),
so "before" is the SFT adapter's own held-out score.

    python bench/opsd_recipe.py --episodes /tmp/demo-fed/train/episodes.jsonl \\
        --init-adapter /tmp/demo-fed/train/run/adapter --out out/opsd-recipe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_sampler(base_dir: Path, port: int, cache: Path, threads: int) -> subprocess.Popen:
    """The CPU sampler as a process on ``port``, answering /health before this returns."""
    import httpx

    env = os.environ | {"FANROUTE_PORT": str(port), "FANROUTE_BASE_MODEL": str(base_dir),
                        "FANROUTE_CONSUME_ADAPTERS": "false", "FANROUTE_ADAPTER_CACHE_DIR": str(cache),
                        "FANROUTE_THREADS": str(threads), "FANROUTE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "services.sampler"], cwd=ROOT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the sampler exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a process we started: polling its health endpoint is the readiness signal
    proc.terminate()
    raise RuntimeError("the sampler did not answer /health within 300 s")


def plot(metrics_path: Path, png: Path) -> dict:
    """KL and mismatch per step, and the sampled and held-out reward, in one figure; the figures as data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines()]
    steps = [r for r in rows if "kl" in r and "event" not in r]
    evals = [r for r in rows if "test/ndcg" in r and "event" not in r]
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(x, [r["kl"] for r in steps], marker="o", ms=3)
    axes[0].set(title="teacher–student KL (per token)", xlabel="step", ylabel="log p − log q on samples")
    axes[1].semilogy(x, [max(r["mismatch"], 1e-9) for r in steps], marker="o", ms=3, label="mean")
    axes[1].semilogy(x, [max(r["mismatch_max"], 1e-9) for r in steps], marker=".", ms=3, label="max")
    axes[1].axhline(0.03, color="r", ls="--", lw=1, label="healthy < 0.03")
    axes[1].set(title="train–inference mismatch |Δ logprob|", xlabel="step")
    axes[1].legend(fontsize=8)
    axes[2].plot(x, [r["reward"] for r in steps], marker="o", ms=3, label="sampled orderings (train)")
    axes[2].plot([r["step"] for r in evals], [r["test/ndcg"] for r in evals], marker="s", label="held-out greedy")
    axes[2].set(title="nDCG vs the episode's grades", xlabel="step", ylim=(0, 1.02))
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return {"steps": len(steps), "kl": [round(r["kl"], 4) for r in steps],
            "mismatch_first": steps[0]["mismatch"] if steps else None,
            "mismatch_max": max((r["mismatch_max"] for r in steps), default=None),
            "entropy_first_last": [steps[0]["entropy"], steps[-1]["entropy"]] if steps else None,
            "reward_train_first_last": [steps[0]["reward"], steps[-1]["reward"]] if steps else None,
            "held_out": [{k: r[k] for k in ("step", "test/ndcg", "test/top1", "test/parse_ok", "test/n")}
                         for r in evals],
            "step_time_s_mean": sum(r["step_time_s"] for r in steps) / len(steps) if steps else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=Path, default=Path("/tmp/demo-fed/train/episodes.jsonl"))
    p.add_argument("--init-adapter", type=Path, default=Path("/tmp/demo-fed/train/run/adapter"))
    p.add_argument("--out", type=Path, default=ROOT / "out" / "opsd-recipe")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--kl-coef", type=float, default=1.0)
    p.add_argument("--eval-max", type=int, default=38)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)

    from services.models.prepare import DEFAULT_BASE, resolve_base
    from services.tools.serving import free_port
    from services.trainer.opsd import train_opsd
    from services.trainer.settings import TrainerSettings

    base = resolve_base(DEFAULT_BASE, prepare=True)
    port = args.port or free_port()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    settings = TrainerSettings(
        base_model=DEFAULT_BASE, output_dir=run_dir, episodes_file=args.episodes, allow_uncalibrated=True,
        init_adapter=args.init_adapter if args.init_adapter.is_dir() else None, max_steps=args.steps,
        batch_size=args.batch, lr=args.lr, lr_schedule="constant", eval_fraction=0.1, eval_every=args.steps // 2,
        eval_max_examples=args.eval_max, checkpoint_every=0, threads=args.threads, model_id="router-opsd",
        run={"type": "opsd", "sampler_url": f"http://127.0.0.1:{port}", "group_size": args.group,
             "kl_penalty_coef": args.kl_coef, "max_new_tokens": 40})
    t0 = time.perf_counter()
    sampler = start_sampler(base, port, args.out / "sampler-cache", args.threads)
    try:
        result = train_opsd(settings)
    finally:
        sampler.terminate()
        sampler.wait(timeout=30)
    figures = plot(run_dir / "metrics.jsonl", args.out / "opsd_recipe.png")
    figures |= {"wall_s": time.perf_counter() - t0, "init_adapter": str(settings.init_adapter),
                "episodes": str(args.episodes), "train_rows": len(result.plan.examples),
                "settings": {"steps": args.steps, "batch": args.batch, "group": args.group, "lr": args.lr,
                             "kl_penalty_coef": args.kl_coef, "threads": args.threads}}
    (args.out / "opsd_recipe.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
