"""Benchmark: the router's decision latency, generating an ordering vs scoring the candidates, same run.

The CPU sampler serves SmolLM2-135M-Instruct in its own process (``python -m services.sampler``, as
deployed; ``--server inline``: in this process, uvicorn on a free loopback port), with a freshly initialised LoRA adapter loaded as ``router@1``
(r=8, alpha=16, q/k/v/o: the trainer's defaults; LoRA's B starts at zero, so its numbers are the
base model's, its cost is an adapter's) unless ``--no-adapter`` (the base model). Two paths decide
the provider for the same queries (``sample_queries(seed=0)``), closed loop, at each concurrency:

* ``generate`` (today's router): ``POST /v1/chat/completions`` with the router's messages
  (``services.router.client.chat_request``), ``--gen-tokens`` greedy tokens; the decision is the
  first provider the reply names.
* ``score``: one ``POST /v1/completions`` with K prompts, the chat template's rendering of the same
  messages (``add_generation_prompt=True``) followed by each provider name of the market,
  ``max_tokens=1, temperature=0, prompt_logprobs=0``; the decision is the provider whose name's
  tokens have the highest summed logprob.
* ``first-token``: the gateway's ``RouterClient`` in ``first-token`` mode: one one-token completion of
  the prompt with its 20 alternatives decides between names that start differently; by default the
  lean path (``prompt_logprobs=False``): the two ``web-`` names (one first token) are split in the same
  call by a second prompt ending in their common prefix; ``--first-token-prompt-logprobs``: by a
  K-prompt call of their own when they could win. Its decisions are compared query by query with the
  ``score`` path's (``agreement_first_token_vs_score``).

The served ``router@1`` is scored through the sampler's merged copy (``--merged-copies 0``: through peft,
as before merged copies; ``services/sampler/merged.py``).

``--adapter DIR`` serves a trained adapter instead of a fresh one (agreement means little on an
untrained one), and ``--queries-file`` takes the queries from a traces or episodes JSONL, or from a
``fanroute eval`` report (``out/demo/eval/eval.json``: the demo's held-out queries), instead of
``sample_queries``.

Latency is client-side per decision (HTTP included); ``--warmup`` decisions per path and level are
not measured. Reports p50/p99 per path and level and the ratio generate/score, as a table and as
JSON (bench/results/router_decision.json), with the load average before and after.

    python bench/router_decision.py --decisions 200 --concurrency 1,20
    python bench/router_decision.py --paths score,first-token --adapter out/demo/train/run/adapter \
        --queries-file out/demo/eval/eval.json --decisions 176 --warmup 10 --dtype bfloat16
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

from bench.sampler_support import (  # noqa: E402
    LORA,
    fresh_adapter,
    load_queries,
    pct,
    sampler_server,
)

PATHS = ("generate", "score", "first-token")


def score_decision(choices: list[dict[str, Any]], names: list[str], prefix_len: int) -> str:
    """The provider whose name (the prompt tokens after ``prefix_len``) has the highest summed logprob."""
    def total(choice: dict[str, Any]) -> float:
        entries = choice["prompt_logprobs"][prefix_len:]
        return sum(next(iter(e.values()))["logprob"] for e in entries)  # the actual token comes first
    return names[max(range(len(names)), key=lambda i: total(choices[i]))]


class Case:
    """One query, ready for both paths: the chat body, the K completion prompts and the prefix length."""

    def __init__(self, tokenizer: Any, model: str, names: list[str], query: str, gen_tokens: int) -> None:
        from services.common.prompt import router_messages
        from services.router.client import chat_request

        self.model, self.query = model, query
        self.chat = chat_request(model, names, query, gen_tokens)
        text = tokenizer.apply_chat_template(router_messages(names, query), add_generation_prompt=True,
                                             tokenize=False)
        self.score = {"model": model, "prompt": [text + n for n in names], "max_tokens": 1, "temperature": 0,
                      "prompt_logprobs": 0}
        self.prefix_len = len(tokenizer.encode(text))


async def decide(http: aiohttp.ClientSession, base: str, path: str, case: Case,
                 names: list[str], client: Any = None) -> tuple[float, str | None, int]:
    """One decision: (latency ms, the provider chosen or None, completion tokens)."""
    from services.router.parse import UnparseableOrdering, parse_ordering

    t0 = time.perf_counter()
    if path == "first-token":
        answer = await client.route(case.model, names, case.query)
        return (time.perf_counter() - t0) * 1000.0, answer.ordering[0], 1
    url, body = (("/v1/chat/completions", case.chat) if path == "generate" else ("/v1/completions", case.score))
    async with http.post(base + url, json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {data}")
    if path == "generate":
        try:
            choice = parse_ordering(data["choices"][0]["message"]["content"], names).ordering[0]
        except (UnparseableOrdering, IndexError):
            choice = None
    else:
        choice = score_decision(data["choices"], names, case.prefix_len)
    ms = (time.perf_counter() - t0) * 1000.0
    return ms, choice, int(data["usage"]["completion_tokens"])


async def closed_loop(http: aiohttp.ClientSession, base: str, path: str, cases: list[Case], names: list[str],
                      concurrency: int, progress_every: int, prompt_logprobs: bool = False,
                      round_size: int = 0) -> dict[str, Any]:
    """``len(cases)`` decisions by ``concurrency`` workers, each sending its next one as soon as it has an answer;
    with ``round_size``, also the p50 of each round of that many cases (the spread within one run)."""
    from services.router.client import RouterClient

    queue = list(enumerate(cases))
    lat: list[float] = []
    lat_of: list[float] = [0.0] * len(cases)
    chosen: list[str | None] = [None] * len(cases)
    tokens: list[int] = []
    t0 = time.perf_counter()
    client = (RouterClient(base, mode="first-token", timeout_s=60.0, prompt_logprobs=prompt_logprobs)
              if path == "first-token" else None)
    if client is not None:  # learn the names' first tokens before the clock matters (once per adapter)
        await client.route(cases[0].model, names, cases[0].query)
        t0 = time.perf_counter()

    async def worker() -> None:
        while queue:
            i, case = queue.pop(0)
            ms, choice, n = await decide(http, base, path, case, names, client)
            lat.append(ms)
            lat_of[i] = ms
            chosen[i] = choice
            tokens.append(n)
            if progress_every and len(lat) % progress_every == 0:
                print(f"  [{path} c={concurrency}] {len(lat)}/{len(cases)} decisions, "
                      f"p50 so far {np.percentile(lat, 50):.0f} ms", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if client is not None:
            await client.close()
    wall = time.perf_counter() - t0
    rounds = [lat_of[r:r + round_size] for r in range(0, len(cases), round_size)] if round_size else []
    return {**pct(lat), "decisions_per_s": len(lat) / wall, "wall_s": wall,
            "round_p50": [float(np.percentile(r, 50)) for r in rounds if r],
            "completion_tokens_mean": float(np.mean(tokens)),
            "undecided": sum(c is None for c in chosen), "chosen": chosen}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.common.settings import KafkaSettings
    from services.providers.collections import sample_queries
    from services.providers.markets import market
    from services.sampler.settings import SamplerSettings

    names = [p.name for p in market(args.market)]
    settings = SamplerSettings(base_model=args.base, served_model_name="base", threads=args.threads,
                               dtype=args.dtype, consume_adapters=False, score_batch_wait_ms=args.batch_wait_ms,
                               score_batch_max_wait_ms=args.batch_max_wait_ms,
                               merged_copies=args.merged_copies, fused_layers=args.fused_layers,
                               merged_dtype=args.merged_dtype,
                               adapter_cache_dir=Path(tempfile.mkdtemp(prefix="bench-rd-cache-")),
                               kafka=KafkaSettings(bootstrap_servers="memory://"))
    levels = [int(c) for c in args.concurrency.split(",")]
    out: dict[str, Any] = {"model": args.base, "dtype": args.dtype, "market": args.market, "providers": names,
                           "server": args.server,
                           "adapter": None if args.no_adapter else {"kind": "fresh LoRA (B=0)", **LORA},
                           "gen_tokens": args.gen_tokens, "paths": args.paths, "rounds": args.rounds,
                           "first_token_prompt_logprobs": args.first_token_prompt_logprobs, "decisions": args.decisions,
                           "warmup": args.warmup,
                           "concurrency": levels, "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
                           "settings": {k: getattr(settings, k) for k in (
                               "score_max_batch", "score_batch_wait_ms", "score_batch_max_wait_ms",
                               "score_max_forward_tokens",
                               "score_row_tokens", "prefix_cache_entries", "prefix_cache_min_tokens", "merged_copies",
                               "fused_layers", "merged_dtype")}}
    async with sampler_server(settings, args.server) as (base, metric, tok):
        out["torch_threads"] = torch.get_num_threads()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:
            model = "base"
            if args.adapter is not None:
                out["adapter"] = {"kind": f"trained ({args.adapter})"}
            if not args.no_adapter:
                path = args.adapter or fresh_adapter(args.base, Path(tempfile.mkdtemp(prefix="bench-rd-lora-")) / "router")
                async with http.post(base + "/v1/load_lora_adapter",
                                     json={"lora_name": "router@1", "lora_path": str(path)}) as r:
                    assert r.status == 200, await r.text()
                model = "router@1"
            queries = (load_queries(args.queries_file)[:args.decisions + args.warmup] if args.queries_file else
                       [q.text for q in sample_queries(limit=args.decisions + args.warmup, seed=0)])
            out["queries"] = str(args.queries_file) if args.queries_file else "sample_queries(seed=0)"
            cases = [Case(tok, model, names, q, args.gen_tokens) for q in queries]
            if args.rounds > 1 and len(cases) - args.warmup <= settings.prefix_cache_entries:
                raise SystemExit(f"--rounds {args.rounds}: {len(cases) - args.warmup} queries would come back "
                                 f"while the prefix cache ({settings.prefix_cache_entries} prompts) still holds them")
            out["score_prompt_tokens_mean"] = float(np.mean([c.prefix_len for c in cases]))
            results: dict[str, dict[str, Any]] = {}
            for level in levels:
                for path in args.paths:
                    print(f"{path} at concurrency {level}: {args.warmup} warm-up + {args.decisions} decisions",
                          file=sys.stderr, flush=True)
                    await closed_loop(http, base, path, cases[:args.warmup], names, min(level, args.warmup or 1), 0,
                                      args.first_token_prompt_logprobs)
                    before = [await metric(f"fanroute_sampler_score_batch_requests_{x}") or 0 for x in ("count", "sum")]
                    measured = cases[args.warmup:]
                    res = await closed_loop(http, base, path, measured * args.rounds, names, level, args.progress,
                                            args.first_token_prompt_logprobs, round_size=len(measured))
                    after = [await metric(f"fanroute_sampler_score_batch_requests_{x}") or 0 for x in ("count", "sum")]
                    res["chosen"] = res["chosen"][:len(measured)]  # decisions compared on the first round
                    res["forwards"] = after[0] - before[0]  # scoring batches (one forward each, or a few)
                    res["requests_per_forward"] = (after[1] - before[1]) / max(after[0] - before[0], 1)
                    results[f"{path}@{level}"] = res
            chosen = {k: r.pop("chosen") for k, r in results.items()}
            out["results"] = results
            out["ratio_generate_over_score"] = {
                str(level): {q: results[f"generate@{level}"][q] / results[f"score@{level}"][q]
                             for q in ("p50", "p99")} for level in levels} \
                if {"generate", "score"} <= set(args.paths) else {}
            out["ratio_score_over_first_token"] = {
                str(level): {q: results[f"score@{level}"][q] / results[f"first-token@{level}"][q]
                             for q in ("p50", "p99")} for level in levels} \
                if {"score", "first-token"} <= set(args.paths) else {}
            if {"score", "first-token"} <= set(args.paths):
                pairs = [(a, b) for level in levels
                         for a, b in zip(chosen[f"score@{level}"], chosen[f"first-token@{level}"], strict=True)]
                out["agreement_first_token_vs_score"] = {"same": sum(a == b for a, b in pairs), "n": len(pairs),
                                                         "share": sum(a == b for a, b in pairs) / len(pairs)}
            out["chosen"] = chosen  # per path and level, query by query (for --reference comparisons)
            if args.reference is not None:  # e.g. this run in bf16 against an fp32 run's K-prompt decisions
                ref = json.loads(args.reference.read_text())
                out["agreement_vs_reference"] = {
                    "reference": str(args.reference), "reference_dtype": ref["dtype"],
                    **{k: _agree(v, ref["chosen"].get(f"score@{k.split('@')[1]}")) for k, v in chosen.items()}}
            out["sampler"] = {
                "score_batches": await metric("fanroute_sampler_score_batch_requests_count"),
                "score_requests": await metric("fanroute_sampler_score_batch_requests_sum"),
                "prefix_cache": {o: await metric("fanroute_sampler_score_forwards_total", cache=o)
                                 for o in ("hit", "partial", "miss")},
                "prompt_tokens": await metric("fanroute_sampler_tokens_total", kind="prompt"),
                "prompt_tokens_reused": await metric("fanroute_sampler_tokens_total", kind="prompt_reused"),
                "prompt_tokens_forwarded": await metric("fanroute_sampler_tokens_total", kind="prompt_forwarded")}
            out["sampler"]["forwarded_tokens_per_decision"] = (out["sampler"]["prompt_tokens_forwarded"] or 0) \
                / max(1.0, out["sampler"]["score_requests"] or 0)
    out["loadavg_after"] = os.getloadavg()
    return out


def _agree(mine: list[str | None], ref: list[str | None] | None) -> dict[str, Any] | None:
    """How many of ``mine`` equal the reference run's K-prompt decisions at the same level."""
    if ref is None or len(ref) != len(mine):
        return None
    same = sum(a == b for a, b in zip(mine, ref))
    return {"same": same, "n": len(mine), "share": same / len(mine)}


def report(out: dict[str, Any]) -> None:
    print(f"\nrouter decision latency, {out['model']} ({out['dtype']}), "
          f"{'adapter: ' + out['adapter']['kind'] if out['adapter'] else 'base model'}, {out['cpus']} CPUs, "
          f"{out['torch_threads']} torch threads, load {out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}")
    print(f"{'path':<10}{'conc':>5}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'dec/s':>8}{'out tok':>8}"
          f"{'req/fwd':>8}")
    for level in out["concurrency"]:
        for path in [p for p in PATHS if f"{p}@{level}" in out["results"]]:
            r = out["results"][f"{path}@{level}"]
            rounds = r.get("round_p50") or []
            spread = f"   rounds' p50 {min(rounds):.0f}-{max(rounds):.0f}" if len(rounds) > 1 else ""
            print(f"{path:<10}{level:>5}{r['p50']:>10.0f}{r['p99']:>10.0f}{r['mean']:>10.0f}"
                  f"{r['decisions_per_s']:>8.1f}{r['completion_tokens_mean']:>8.1f}{r['requests_per_forward']:>8.1f}"
                  + spread)
        ratio = out["ratio_generate_over_score"].get(str(level))
        if ratio:
            print(f"{'ratio':<10}{level:>5}{ratio['p50']:>9.1f}x{ratio['p99']:>9.1f}x   (generate / score)")
        ratio = out.get("ratio_score_over_first_token", {}).get(str(level))
        if ratio:
            print(f"{'ratio':<10}{level:>5}{ratio['p50']:>9.1f}x{ratio['p99']:>9.1f}x   (score / first-token)")
    agree = out.get("agreement_first_token_vs_score")
    if agree:
        print(f"first-token decision = score decision on {agree['same']}/{agree['n']} ({agree['share']:.1%})")
    for key, a in (out.get("agreement_vs_reference") or {}).items():
        if isinstance(a, dict):
            print(f"{key} = the reference's ({out['agreement_vs_reference']['reference_dtype']}) score decision "
                  f"on {a['same']}/{a['n']} ({a['share']:.1%})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decisions", type=int, default=200, help="measured decisions per path and concurrency")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--concurrency", default="1,20", help="comma-separated closed-loop concurrencies")
    p.add_argument("--gen-tokens", type=int, default=8, help="greedy tokens of the generate path")
    p.add_argument("--market", default="federated")
    p.add_argument("--first-token-prompt-logprobs", action="store_true",
                   help="first-token path: resolve a shared first token by a K-prompt call with prompt_logprobs "
                        "(default: the lean path, one call with the names' common prefix as a second prompt)")
    p.add_argument("--paths", default="generate,score,first-token",
                   type=lambda v: [x for x in PATHS if x in v.split(",")],
                   help="which paths to run (two of them, for their ratio)")
    p.add_argument("--adapter", type=Path, default=None, help="a trained adapter to serve (default: a fresh one)")
    p.add_argument("--queries-file", type=Path, default=None,
                   help="traces or episodes JSONL, or an eval.json (its held-out queries), to take the queries "
                        "from (default: sample_queries)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    from services.sampler.settings import SamplerSettings
    sampler_default = {name: f.default for name, f in SamplerSettings.model_fields.items()}
    p.add_argument("--batch-wait-ms", type=float, default=sampler_default["score_batch_wait_ms"], help="the sampler's")
    p.add_argument("--rounds", type=int, default=1, help="measure each level over the queries this many times "
                   "(decisions compared on the first; refused where a query could still be in the prefix cache)")
    p.add_argument("--batch-max-wait-ms", type=float, default=sampler_default["score_batch_max_wait_ms"],
                   help="the sampler's score_batch_max_wait_ms (waits again while requests keep arriving)")
    p.add_argument("--server", choices=["process", "inline"], default="process",
                   help="the sampler in its own process (as deployed) or in this one (the load generator's)")
    p.add_argument("--merged-dtype", default=sampler_default["merged_dtype"],
                   choices=["same", "auto", "float32", "bfloat16"],
                   help="the sampler's merged_dtype: the router copy's dtype (bfloat16 beside an fp32 --dtype)")
    p.add_argument("--merged-copies", type=int, default=sampler_default["merged_copies"],
                   help="the sampler's merged_copies (0: score router@1 through peft, as before merged copies)")
    p.add_argument("--fused-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="the sampler's fused_layers: a bf16 merged copy's Llama layers fused (services.sampler.fused)")
    p.add_argument("--no-adapter", action="store_true", help="serve the base model, no LoRA")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--progress", type=int, default=50, help="progress line every N decisions (0: none)")
    p.add_argument("--reference", type=Path, default=None,
                   help="an earlier run's JSON: report each path's agreement with its score-path decisions")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router_decision.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.reference is not None and not args.reference.is_file():
        p.error(f"--reference {args.reference}: no such file")
    if args.base is None:
        from services.models.prepare import prepare_base

        args.base = str(prepare_base())
    out = asyncio.run(run(args))
    report(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
