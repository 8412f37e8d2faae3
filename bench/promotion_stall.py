"""Benchmark: router decisions while a new router version loads — does a promotion stall routing?

When a version of a ``merged_models`` id (the router) is loaded, the sampler builds its merged scoring
copy (services/sampler/merged.py): ≈ 0.3–0.6 s on a quiet machine, seconds under load. Built under the
engine's lock (``FANROUTE_MERGED_BUILD_ATTEMPTS=0``, how it was before 2026-12-06), every decision
waits for it; built outside (the default), decisions go on. This runs the sampler in its own process
with the deployed version ``router@1`` (a trained adapter), keeps ``--concurrency`` first-token
decisions in flight on it (closed loop, the held-out queries) and meanwhile loads and unloads
``router@2``, ``router@3``, … (the same files: what a promotion's load costs the sampler), once per
setting, both settings in the same run. It reports each setting's decision latency — all decisions,
and those in flight during a load — the loads' durations, and how many decisions took longer than the
gateway's router timeout (each would have been a counted fallback to the best single provider).

    python bench/promotion_stall.py --adapter out/demo/train/run/adapter \\
        --queries-file out/demo/eval/eval.json

Writes bench/results/promotion_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.sampler_support import fresh_adapter, load_queries, pct, sampler_server  # noqa: E402


async def one_setting(args: argparse.Namespace, attempts: int, names: list[str], queries: list[str],
                      adapter: Path) -> dict[str, Any]:
    """One sampler process with ``merged_build_attempts=attempts``: decisions on router@1 while
    router@2.. load and unload."""
    from services.common.settings import KafkaSettings
    from services.router.client import RouterClient
    from services.sampler.settings import SamplerSettings

    settings = SamplerSettings(base_model=args.base, served_model_name="base", dtype=args.dtype,
                               consume_adapters=False, merged_build_attempts=attempts,
                               adapter_cache_dir=Path(tempfile.mkdtemp(prefix="bench-ps-cache-")),
                               kafka=KafkaSettings(bootstrap_servers="memory://"))
    decisions: list[tuple[float, float]] = []  # (start, end), perf_counter seconds
    loads: list[tuple[float, float]] = []
    async with sampler_server(settings, "process") as (base, metric, _tok), aiohttp.ClientSession() as http:
        async def load(name: str) -> None:
            async with http.post(base + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)}) as r:
                assert r.status == 200, await r.text()

        await load("router@1")
        client = RouterClient(base, mode="first-token", timeout_s=60.0)
        for q in queries[:args.warmup]:  # the names' tokens, the prefix cache, the first forwards
            await client.route("router@1", names, q)
        stop = asyncio.Event()
        todo = list(queries[args.warmup:])

        async def decider() -> None:
            i = 0
            while not stop.is_set():
                q = todo[i % len(todo)]
                i += 1
                t0 = time.perf_counter()
                await client.route("router@1", names, q)
                decisions.append((t0, time.perf_counter()))

        async def promoter() -> None:
            await asyncio.sleep(args.steady_s)  # steady state first: the baseline latency of this setting
            for k in range(2, args.promotions + 2):
                t0 = time.perf_counter()
                await load(f"router@{k}")
                loads.append((t0, time.perf_counter()))
                async with http.post(base + "/v1/unload_lora_adapter", json={"lora_name": f"router@{k}"}) as r:
                    assert r.status == 200, await r.text()
                print(f"  attempts={attempts}: router@{k} loaded in {loads[-1][1] - t0:.2f} s", file=sys.stderr,
                      flush=True)
                await asyncio.sleep(args.gap_s)
            stop.set()

        try:
            await asyncio.gather(promoter(), *(decider() for _ in range(args.concurrency)))
        finally:
            await client.close()
        merged = await metric("fanroute_sampler_adapter_events_total", event="merged")

    def overlaps(d: tuple[float, float]) -> bool:
        return any(d[0] < end and d[1] > start for start, end in loads)

    ms = [(e - s) * 1000.0 for s, e in decisions]
    during = [(e - s) * 1000.0 for s, e in decisions if overlaps((s, e))]
    return {"merged_build_attempts": attempts, "decisions": pct(ms), "during_loads": pct(during) if during else None,
            "steady": pct([(e - s) * 1000.0 for s, e in decisions if not overlaps((s, e))]),
            "load_s": [round(e - s, 3) for s, e in loads], "copies_merged": merged,
            "over_router_timeout": sum(m > args.router_timeout_s * 1000.0 for m in ms)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.providers.collections import sample_queries
    from services.providers.markets import market

    names = [p.name for p in market(args.market)]
    queries = (load_queries(args.queries_file) if args.queries_file else
               [q.text for q in sample_queries(limit=200, seed=0)])
    if len(queries) <= args.warmup:
        raise SystemExit(f"{len(queries)} queries: more than --warmup {args.warmup} are needed")
    adapter = args.adapter or fresh_adapter(args.base, Path(tempfile.mkdtemp(prefix="bench-ps-lora-")) / "router")
    out: dict[str, Any] = {"adapter": str(args.adapter or "fresh LoRA (B=0)"), "dtype": args.dtype,
                           "concurrency": args.concurrency, "promotions": args.promotions,
                           "router_timeout_s": args.router_timeout_s, "cpus": os.cpu_count(),
                           "queries": str(args.queries_file or "sample_queries(seed=0)"),
                           "loadavg_before": os.getloadavg(), "settings": {}}
    for attempts in (0, args.attempts):  # the baseline (under the lock) first, then the default
        print(f"merged_build_attempts={attempts}", file=sys.stderr, flush=True)
        out["settings"][str(attempts)] = await one_setting(args, attempts, names, queries, adapter)
    out["loadavg_after"] = os.getloadavg()
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nrouter@1 decisions at {out['concurrency']} concurrent while router@2.. load ({out['dtype']}, "
          f"{out['cpus']} cpus); ms")
    print(f"{'copy built':<22} {'all p50':>8} {'p99':>7} {'max':>7} {'in a load: p50':>15} {'p99':>7} {'max':>7} "
          f"{'> timeout':>9}  loads (s)")
    for attempts, r in out["settings"].items():
        d, dl = r["decisions"], r["during_loads"] or {"p50": 0, "p99": 0, "max": 0}
        label = "under the lock" if attempts == "0" else "outside the lock"
        print(f"{label:<22} {d['p50']:>8.0f} {d['p99']:>7.0f} {d['max']:>7.0f} {dl['p50']:>15.0f} {dl['p99']:>7.0f} "
              f"{dl['max']:>7.0f} {r['over_router_timeout']:>9}  {r['load_s']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from services.gateway.settings import RoutingSettings
    from services.sampler.settings import SamplerSettings

    default_timeout = RoutingSettings.model_fields["router_timeout_s"].default
    default_attempts = SamplerSettings.model_fields["merged_build_attempts"].default
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapter", type=Path, default=None, help="a trained adapter to serve (default: a fresh one)")
    p.add_argument("--queries-file", type=Path, default=None,
                   help="traces or episodes JSONL, or an eval.json (default: sample_queries)")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--market", default="federated")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, default=8, help="decisions in flight")
    p.add_argument("--promotions", type=int, default=3, help="router@2.. loaded (and unloaded) per setting")
    p.add_argument("--steady-s", type=float, default=5.0, help="seconds of decisions before the first load")
    p.add_argument("--gap-s", type=float, default=3.0, help="seconds between loads")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--attempts", type=int, default=default_attempts,
                   help="merged_build_attempts of the measured setting (the baseline is 0: under the lock)")
    p.add_argument("--router-timeout-s", type=float, default=default_timeout, help="the gateway's router deadline")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "promotion_stall.json")
    args = p.parse_args(argv)
    for flag, value, low in (("--concurrency", args.concurrency, 1), ("--promotions", args.promotions, 1),
                             ("--attempts", args.attempts, 1)):
        if value < low:
            p.error(f"{flag} must be at least {low} (got {value})")
    if args.base is None:
        from services.models.prepare import prepare_base

        args.base = str(prepare_base())
    out = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    report(out)
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
