"""Benchmark: the router's matmuls in bf16 (as the sampler's fused copy runs them) against oneDNN int8.

Would int8 weights and activations (AMX-INT8 where the CPU has it) give the fused bf16 copy the third
more throughput the 20-concurrent decision target needs? Each of a decoder layer's four matmuls
(q/k/v packed, ``o_proj``, ``gate``/``up`` (two, one input), ``down_proj``) at the router's shapes, on
``--rows`` activation rows (a 20-decision forward is ≈ 800 new tokens), side by side in one run:

* ``bf16``: ``services.sampler.merged.packed_linear`` with a packed weight, the sampler's path;
* ``int8 matmul``: ``torch.ops.onednn.qlinear_pointwise`` on an already quantized activation (uint8,
  one scale per tensor) and a per-channel int8 weight, bf16 out: the most int8 could save;
* ``int8 + quantize``: the same with the activation's dynamic quantization (min/max, scale, round)
  counted, as a forward would have to pay it before each matmul (q/k/v, ``o``, ``gate``+``up`` once,
  ``down``).

Random weights and activations: a speed comparison; the decision's accuracy under int8 is not
measured here. Reports ms per call, per layer summed, and the ratios to bf16.

    python bench/int8_matmul.py --rows 800,40 --out bench/results/int8_matmul.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: SmolLM2-135M's shapes (out, in): hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64.
MATMULS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (1536, 576), "down": (576, 1536)}
#: How often each matmul runs in a layer (gate and up share their input: one quantization, two matmuls).
CALLS = {"qkv": 1, "o": 1, "gate_up": 2, "down": 1}


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median ms of ``reps`` calls after a warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(rows: int, reps: int) -> dict[str, dict[str, float]]:
    """ms per layer of each matmul at ``rows`` activation rows, in the three variants."""
    import torch

    from services.sampler.merged import pack_weight, packed_linear

    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated")  # the quantized dtypes' notice
    out: dict[str, dict[str, float]] = {}
    for name, (n_out, n_in) in MATMULS.items():
        w = torch.randn(n_out, n_in) * 0.05
        x = torch.randn(rows, n_in).to(torch.bfloat16)
        packed = pack_weight(w.to(torch.bfloat16))
        w_scale = (w.abs().amax(1) / 127).float()
        q_packed = torch.ops.onednn.qlinear_prepack(
            torch.round(w / w_scale[:, None]).clamp(-128, 127).to(torch.int8), [rows, n_in])
        w_zp = torch.zeros(n_out, dtype=torch.int64)

        def quantize() -> tuple[torch.Tensor, float, int]:
            lo, hi = torch.aminmax(x)
            scale = max(float(hi) - float(lo), 1e-8) / 255
            zp = int(round(-float(lo) / scale))
            return torch.quantize_per_tensor(x.float(), scale, zp, torch.quint8).int_repr(), scale, zp

        xq, scale, zp = quantize()

        def int8(q: torch.Tensor = xq, s: float = scale, z: int = zp) -> torch.Tensor:
            return torch.ops.onednn.qlinear_pointwise(q, s, z, q_packed, w_scale, w_zp, None, 1.0, 0,
                                                      torch.bfloat16, "none", [], "")

        calls, matmul = CALLS[name], timed(int8, reps)
        out[name] = {"bf16": calls * timed(lambda: packed_linear(x, packed), reps),
                     "int8_matmul": calls * matmul,
                     "int8_quantize": timed(lambda: int8(*quantize()), reps) + (calls - 1) * matmul}
    out["layer"] = {k: sum(v[k] for v in out.values()) for k in ("bf16", "int8_matmul", "int8_quantize")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="800,40", help="comma-separated activation rows (tokens in a forward)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per variant (1..10000)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/int8_matmul.json"))
    args = ap.parse_args(argv)
    try:
        sizes = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if not sizes or not all(1 <= r <= 100_000 for r in sizes) or not 1 <= args.reps <= 10_000:
        ap.error("--rows: each 1..100000; --reps: 1..10000")
    result: dict[str, Any] = {"reps": args.reps, "rows": {}}
    for rows in sizes:
        per = measure(rows, args.reps)
        result["rows"][str(rows)] = per
        print(f"{rows} rows (ms per layer)   bf16    int8 matmul   int8 + quantize")
        for name, v in per.items():
            print(f"  {name:<20} {v['bf16']:7.3f}   {v['int8_matmul']:7.3f} ({v['int8_matmul'] / v['bf16']:.2f}×)"
                  f"   {v['int8_quantize']:7.3f} ({v['int8_quantize'] / v['bf16']:.2f}×)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
