"""Benchmark: one router decision's forward in isolation, by weight format, same run; and what int8 does to it.

A first-token decision forwards the query part of the router prompt (≈ 44 tokens on the demo's held-out
queries) after the cached system prompt (≈ 90 tokens) and reads one row of logits. This times exactly
that forward (``logits_to_keep=1``) with the base model and with a LoRA adapter (unmerged as the
sampler serves it, and merged), in fp32 and bf16, then with dynamic int8 linear layers, and reports
each as a ratio to fp32 unmerged. Int8 is also checked for what a decision needs: the argmax token of
a whole-prompt forward compared with fp32's, position by position, over real router prompts.

    python bench/router_forward.py --adapter out/demo/train/run/adapter

Writes bench/results/router_forward.json.
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


def _time_forward(model: Any, prompt: list[int], cached: int, reps: int) -> dict[str, float]:
    """p50 / min ms of forwarding ``prompt[cached:]`` after a cache holding ``prompt[:cached]``."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        warm = DynamicCache(config=model.config)
        model(input_ids=ids[:, :cached], past_key_values=warm, use_cache=True)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in warm.layers]
        times = []
        for _ in range(reps):
            cache = DynamicCache(kv, config=model.config)
            t0 = time.perf_counter()
            model(input_ids=ids[:, cached:], past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50_ms": times[len(times) // 2], "min_ms": times[0]}


def _argmax_agreement(model: Any, reference: Any, prompts: list[list[int]]) -> float:
    """Share of positions whose most likely next token is the reference model's."""
    import torch

    same = total = 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            a, b = model(input_ids=ids).logits[0].argmax(-1), reference(input_ids=ids).logits[0].argmax(-1)
            same, total = same + int((a == b).sum()), total + len(p)
    return same / total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", type=Path, required=True, help="a trained LoRA adapter directory")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--reps", type=int, default=21, help="timed forwards per variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="router prompts for the int8 agreement check")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router_forward.json")
    args = p.parse_args(argv)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common import paths
    from services.common.prompt import router_messages
    from services.providers.collections import sample_queries
    from services.providers.markets import market
    from services.sampler.scoring import shared_length

    torch.set_num_threads(args.threads)
    base = args.base or str(paths.default_base_dir())
    tok = AutoTokenizer.from_pretrained(base)
    names = [m.name for m in market("federated")]
    queries = [q.text for q in sample_queries(seed=0)][:max(args.prompts, 2)]
    prompts = [tok.apply_chat_template(router_messages(names, q), add_generation_prompt=True, tokenize=True)
               for q in queries]
    prompts = [list(getattr(x, "input_ids", x)) for x in prompts]
    system = len(prompts[0])  # the system turn every router prompt shares (cached by the sampler)
    for other in prompts[1:]:
        system = shared_length(prompts[0][:system], other)
    # the query whose part is closest to the held-out queries' mean of ≈ 44 forwarded tokens
    prompt = min(prompts, key=lambda x: abs(len(x) - system - 44))

    def load(dtype: Any, adapter: bool, merged: bool = False) -> Any:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
        if adapter:
            model = PeftModel.from_pretrained(model, str(args.adapter)).eval()
            if merged:
                model = model.merge_and_unload()
        return model

    out: dict[str, Any] = {"base": base, "adapter": str(args.adapter), "threads": args.threads,
                           "cached_tokens": system, "forwarded_tokens": len(prompt) - system, "reps": args.reps,
                           "loadavg_before": os.getloadavg(), "variants": {}}
    variants = [("fp32 base", torch.float32, False, False), ("fp32 lora", torch.float32, True, False),
                ("fp32 lora merged", torch.float32, True, True), ("bf16 base", torch.bfloat16, False, False),
                ("bf16 lora", torch.bfloat16, True, False), ("bf16 lora merged", torch.bfloat16, True, True)]
    for label, dtype, adapter, merged in variants:
        out["variants"][label] = _time_forward(load(dtype, adapter, merged), prompt, system, args.reps)
        print(f"{label:<24}{out['variants'][label]['p50_ms']:>8.1f} ms", file=sys.stderr, flush=True)
    reference = load(torch.float32, True, True)
    q8 = torch.ao.quantization.quantize_dynamic(load(torch.float32, True, True), {torch.nn.Linear}, dtype=torch.qint8)
    out["variants"]["int8 dynamic, lora merged"] = _time_forward(q8, prompt, system, args.reps)
    out["int8_argmax_agreement"] = _argmax_agreement(q8, reference, prompts)
    bf16 = load(torch.bfloat16, True, True)
    out["bf16_argmax_agreement"] = _argmax_agreement(bf16, reference, prompts)
    ref_ms = out["variants"]["fp32 lora"]["p50_ms"]
    out["ratio_to_fp32_lora"] = {k: ref_ms / v["p50_ms"] for k, v in out["variants"].items()}
    out["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'variant':<28}{'p50 ms':>8}{'speed-up':>10}   ({system} cached, {len(prompt) - system} forwarded tokens)")
    for k, v in out["variants"].items():
        print(f"{k:<28}{v['p50_ms']:>8.1f}{out['ratio_to_fp32_lora'][k]:>9.2f}x")
    print(f"argmax token = fp32's: int8 {out['int8_argmax_agreement']:.1%}, bf16 {out['bf16_argmax_agreement']:.1%} "
          f"of positions over {args.prompts} router prompts")
    return out


if __name__ == "__main__":
    main()
