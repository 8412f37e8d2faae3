"""SFT peak memory with and without micro-batches, on the same episodes, in the same run.

Each side is ``fanroute train`` in a process of its own (its peak RSS is its own ``ru_maxrss``), on the
same episodes file, seed and steps; the only difference is ``--micro-batch-tokens`` (the baseline ``0``:
every batch forwarded whole, as before; the other the default, 1024 padded tokens per part). The
gradient is the same without dropout
(``tests/unit/test_trainer.py::test_micro_batches_give_the_same_steps_as_whole_batches``; LoRA dropout
draws its masks per part, so here losses agree to dropout noise); what changes is the peak (a batch of
long queries holds its attention activations for the backward) and the time a step takes.

    python bench/sft_memory.py --episodes out/demo/train/episodes.jsonl --steps 56 \\
        --json-out bench/results/sft_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = ("import json, resource, sys; from services.trainer.cli import main; code = main(sys.argv[1:]); "
         "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True); sys.exit(code)")


def side(episodes: Path, steps: int, micro: int, out_dir: Path, threads: int, base_model: str | None) -> dict:
    """One training run; its peak RSS, step times and losses."""
    run_dir = out_dir / f"micro-{micro}"
    cmd = [sys.executable, "-c", CHILD, "--episodes-file", str(episodes), "--max-steps", str(steps),
           "--allow-uncalibrated", "--eval-every", "0", "--eval-max-examples", "1", "--eval-fraction", "0",
           "--checkpoint-every", "0", "--output-dir", str(run_dir), "--micro-batch-tokens", str(micro),
           "--threads", str(threads), *(["--base-model", base_model] if base_model else [])]
    env = {**os.environ, "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": "memory://", "FANROUTE_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"micro_batch_tokens={micro}: the trainer exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    peak_kb = next(int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    timed = rows[1:]  # the first step warms up
    return {"micro_batch_tokens": micro, "peak_rss_mb": round(peak_kb / 1024, 1), "steps": len(rows),
            "step_time_s": round(sum(r["step_time_s"] for r in timed) / max(1, len(timed)), 3),
            "tokens_per_s": round(sum(r["tokens"] for r in timed) / max(1e-9, sum(r["step_time_s"] for r in timed)), 1),
            "max_micro_batches": max(r.get("micro_batches", 1) for r in rows),
            "losses": [round(r["loss"], 5) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=Path, required=True, help="a `fanroute dataset` JSONL (e.g. the demo's)")
    p.add_argument("--steps", type=int, default=56, help="optimiser steps per side (56 = one demo pass)")
    p.add_argument("--micro", type=int, default=1024, help="the micro-batched side's --micro-batch-tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base-model", default=None, help="default: the trainer's (SmolLM2-135M-Instruct)")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.episodes.is_file():
        p.error(f"--episodes: {args.episodes} is not a file")
    with tempfile.TemporaryDirectory(prefix="sft-memory-") as tmp:
        base, micro = (side(args.episodes, args.steps, m, Path(tmp), args.threads, args.base_model) for m in (0, args.micro))
    drift = max(abs(a - b) for a, b in zip(base["losses"], micro["losses"], strict=True))
    report = {"baseline": base, "micro": micro, "peak_ratio": round(micro["peak_rss_mb"] / base["peak_rss_mb"], 3),
              "time_ratio": round(micro["step_time_s"] / base["step_time_s"], 3), "max_loss_difference": drift,
              "episodes": str(args.episodes), "steps": args.steps, "threads": args.threads}
    print(f"{'side':<22}{'peak RSS MiB':>14}{'s/step':>9}{'tokens/s':>10}{'parts (max)':>13}")
    for name, r in (("whole batches", base), (f"micro {args.micro}", micro)):
        print(f"{name:<22}{r['peak_rss_mb']:>14.0f}{r['step_time_s']:>9.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['max_micro_batches']:>13}")
    print(f"peak ratio micro/whole {report['peak_ratio']:.2f}, time ratio {report['time_ratio']:.2f}, "
          f"largest per-step loss difference {drift:.2e}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
