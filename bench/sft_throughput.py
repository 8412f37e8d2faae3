"""Benchmark: our SFT trainer's tokens/s against TRL's SFTTrainer (+ peft), same run, as a ratio.

Same base model (SmolLM2-135M-Instruct, prepared from the bundled GGUF), same data (episodes in
the router's shape built from the collections' development queries), same LoRA (r=8, alpha=16,
q/k/v/o, no dropout), same batch size, max length and learning rate, loss on the assistant turn
only on both sides (TRL: prompt-completion data with completion_only_loss), fp32 and no gradient
checkpointing on both sides unless --trl-defaults (TRL's own bf16 + checkpointing). Each side runs in its
own process so its peak RSS is its own. Throughput = non-pad tokens / time of optimiser steps,
the first step (warm-up) left out.

    python bench/sft_throughput.py --steps 12 --batch 8
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROVIDERS = ("bio-dense", "bm25-all", "dense-all", "eng-bm25", "lib-bm25")
#: The one LoRA both sides train (ours would otherwise use its default dropout 0.05).
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def make_episodes(n: int, path: Path, seed: int = 0) -> Path:
    """``n`` router episodes over real development queries, with seeded orderings."""
    from datetime import UTC, datetime

    from schemas.episode import ChatMessage, Episode, RewardComponent
    from services.common.ndcg import format_ordering
    from services.common.prompt import system_prompt
    from services.providers.collections import sample_queries

    rng = random.Random(seed)
    eps = []
    for i, q in enumerate(sample_queries(limit=n, seed=seed)):
        names = list(PROVIDERS)
        rng.shuffle(names)
        cut = rng.randint(1, 4)
        tiers = [tuple(names[:cut]), tuple(names[cut:])]
        eps.append(Episode(episode_id=f"bench-{i:05d}", created_at=datetime(2026, 1, 1, tzinfo=UTC),
                           messages=(ChatMessage(role="system", content=system_prompt(PROVIDERS)),
                                     ChatMessage(role="user", content=q.text),
                                     ChatMessage(role="assistant", content=format_ordering(tiers))),
                           rewards=(RewardComponent(component_id=f"c{i}", name="ndcg:bench:x", value=1.0),)))
    path.write_bytes(b"".join(e.to_bytes() + b"\n" for e in eps))
    return path


def run_ours(args: argparse.Namespace) -> dict:
    from services.trainer.settings import TrainerSettings
    from services.trainer.train import train

    out = Path(tempfile.mkdtemp(prefix="bench-ours-"))
    settings = TrainerSettings(base_model=args.base, episodes_file=args.episodes, output_dir=out / "run",
                               allow_uncalibrated=True, max_steps=args.steps, batch_size=args.batch,
                               max_tokens=args.max_tokens, lr=2e-4, eval_every=0, eval_fraction=0.0,
                               checkpoint_every=0, threads=args.threads,
                               lora={"r": LORA["r"], "alpha": LORA["lora_alpha"], "dropout": LORA["lora_dropout"],
                                     "target_modules": tuple(LORA["target_modules"])})
    train(settings, out=lambda line: None)
    recs = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time_s" in r][1:]
    return {"tokens": sum(r["tokens"] for r in steps), "seconds": sum(r["step_time_s"] for r in steps),
            "steps": len(steps)}


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from schemas.base import decode
    from schemas.episode import Episode

    if args.threads:
        torch.set_num_threads(args.threads)
    eps = [decode(Episode, line) for line in args.episodes.read_text().splitlines() if line.strip()]
    rows = [{"prompt": [{"role": m.role, "content": m.content} for m in e.messages[:2]],
             "completion": [{"role": "assistant", "content": e.messages[2].content}]} for e in eps]
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    timing: list[tuple[int, float]] = []

    class Timed(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self._tokens = int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            timing.append((trainer._tokens, time.perf_counter() - self.t0))

    cfg = SFTConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=args.batch,
                    max_steps=args.steps, max_length=args.max_tokens, learning_rate=2e-4, logging_steps=1000,
                    report_to=[], completion_only_loss=True, packing=False, use_cpu=True, save_strategy="no",
                    lr_scheduler_type="linear", dataloader_num_workers=0, seed=0,
                    # same numerics as ours unless asked for TRL's own defaults (bf16 + checkpointing)
                    **({} if args.trl_defaults else {"bf16": False, "gradient_checkpointing": False}))
    lora = LoraConfig(**LORA, task_type="CAUSAL_LM")
    trainer = Timed(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                    peft_config=lora, callbacks=[Clock()])
    trainer.train()
    steps = timing[1:]
    return {"tokens": sum(t for t, _ in steps), "seconds": sum(s for _, s in steps), "steps": len(steps)}


def child(args: argparse.Namespace) -> None:
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--episodes", type=Path, default=None)
    p.add_argument("--trl-defaults", action="store_true",
                   help="leave TRL's SFTConfig defaults (bf16, gradient checkpointing) instead of fp32 like ours")
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sft_throughput.json")
    args = p.parse_args()
    if args.side:
        return child(args)
    from services.models.prepare import prepare_base

    args.base = args.base or str(prepare_base())
    args.episodes = args.episodes or make_episodes(args.steps * args.batch, Path(tempfile.mkdtemp()) / "eps.jsonl")
    results = {}
    for side in ("trl", "ours"):
        print(f"running {side} ...", flush=True)
        cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--batch", str(args.batch),
               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--base", args.base,
               "--episodes", str(args.episodes)] + (["--trl-defaults"] if args.trl_defaults else [])
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
        r = json.loads(line[7:])
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        results[side] = r
    ratio = results["ours"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
    print(f"\n{args.steps} steps x batch {args.batch}, max {args.max_tokens} tokens, {args.threads} threads")
    print(f"{'':<8}{'tokens/s':>10}{'peak RSS MB':>13}{'steps timed':>13}")
    for side, r in results.items():
        print(f"{side:<8}{r['tokens_per_s']:>10.0f}{r['peak_rss_mb']:>13.0f}{r['steps']:>13}")
    print(f"ratio ours/TRL tokens/s: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out_path = args.out.with_name(args.out.stem + "_trl_defaults.json") if args.trl_defaults else args.out
    out_path.write_text(json.dumps({"results": results, "ratio": ratio, "steps": args.steps, "batch": args.batch,
                                    "max_tokens": args.max_tokens, "threads": args.threads,
                                    "trl_defaults": args.trl_defaults}, indent=2) + "\n")


if __name__ == "__main__":
    main()
