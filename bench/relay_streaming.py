"""Benchmark: a streamed call's time to first token through the relay, passed on as decoded vs sampled whole.

The CPU sampler (``python -m services.sampler``) serves SmolLM2-135M-Instruct with a freshly initialised
LoRA adapter as ``policy@1`` (``--no-adapter``: the base); two relays sit in front of it, each in its own
process: ``decoded`` (``FANROUTE_STREAM_SAMPLER=true``, the default: the sampler streams and the relay
passes every piece on) and ``whole`` (``false``, what the relay did before: the whole reply is sampled,
then streamed). Every request is a streamed OpenAI chat call (``stream: true``, as the OpenAI SDK
sends it) of the router's conversation for one of the collections' queries, greedy, at most ``--tokens``
tokens, in its own episode. The two relays alternate request by request
(which goes first alternates too), closed loop at each concurrency; both give the same text (checked).

Reported per concurrency and relay: time to the first content chunk (TTFT) and to the last byte,
p50/p99, and the ratios whole/decoded; JSON in bench/results/relay_streaming.json.

    python bench/relay_streaming.py --requests 40 --concurrency 1,4 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp

from bench.relay_overhead import run_and_write, start, wait_ready
from bench.sampler_support import LORA, fresh_adapter, pct

RELAYS = ("decoded", "whole")


async def streamed(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, float, str, int]:
    """(ms to the first content chunk, ms to the end, the text, chunks with content) of one streamed call."""
    t0, first, parts = time.perf_counter(), None, []
    async with http.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            text = data["choices"][0]["delta"].get("content") if data["choices"] else None
            if text:
                first = first or time.perf_counter()
                parts.append(text)
    end = time.perf_counter()
    return ((first or end) - t0) * 1e3, (end - t0) * 1e3, "".join(parts), len(parts)


async def closed_loop(http: aiohttp.ClientSession, urls: dict[str, str], cases: list[dict[str, Any]],
                      level: int) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {k: [] for k in RELAYS}
    total: dict[str, list[float]] = {k: [] for k in RELAYS}
    chunks: dict[str, list[int]] = {k: [] for k in RELAYS}
    queue = list(enumerate(cases))

    async def worker() -> None:
        while queue:
            i, body = queue.pop(0)
            order = RELAYS if i % 2 == 0 else RELAYS[::-1]
            texts = []
            for name in order:
                first, end, text, n = await streamed(http, urls[name].format(trace=f"bench-{uuid.uuid4().hex[:12]}"),
                                                     body)
                ttft[name].append(first)
                total[name].append(end)
                chunks[name].append(n)
                texts.append(text)
            assert texts[0] == texts[1], texts

    await asyncio.gather(*(worker() for _ in range(level)))
    out: dict[str, Any] = {name: {"ttft_ms": pct(ttft[name]), "total_ms": pct(total[name]),
                                  "content_chunks_mean": sum(chunks[name]) / len(chunks[name])} for name in RELAYS}
    out["ratio_whole_over_decoded"] = {
        "ttft": {q: out["whole"]["ttft_ms"][q] / out["decoded"]["ttft_ms"][q] for q in ("p50", "p99")},
        "total": {q: out["whole"]["total_ms"][q] / out["decoded"]["total_ms"][q] for q in ("p50", "p99")}}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.common.prompt import router_messages
    from services.providers.collections import sample_queries
    from services.providers.markets import market
    from services.tools.serving import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-stream-"))
    sport = free_port()
    ports = {name: free_port() for name in RELAYS}
    common = {"FANROUTE_KAFKA__BOOTSTRAP_SERVERS": "memory://", "FANROUTE_REDIS__URL": "memory://",
              "FANROUTE_LOG_LEVEL": "WARNING"}
    if args.threads:
        common["FANROUTE_THREADS"] = str(args.threads)
    sampler_env = {**common, "FANROUTE_PORT": str(sport), "FANROUTE_BASE_MODEL": args.base,
                   "FANROUTE_SERVED_MODEL_NAME": "base", "FANROUTE_CONSUME_ADAPTERS": "false",
                   "FANROUTE_ADAPTER_CACHE_DIR": str(tmp / "cache")}
    sampler = f"http://127.0.0.1:{sport}"
    procs = [start("services.sampler", sampler_env, tmp / "sampler.log")]
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [p.name for p in market(args.market)]
    out: dict[str, Any] = {"model": args.base, "adapter": None if args.no_adapter else {"kind": "fresh LoRA", **LORA},
                           "tokens": args.tokens, "requests": args.requests, "warmup": args.warmup,
                           "concurrency": levels, "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            path = None if args.no_adapter else fresh_adapter(args.base, tmp / "policy")
            await wait_ready(http, f"{sampler}/health", procs[0], "sampler", tmp / "sampler.log")
            if path is not None:
                async with http.post(f"{sampler}/v1/load_lora_adapter",
                                     json={"lora_name": "policy@1", "lora_path": str(path)}) as r:
                    assert r.status == 200, await r.text()
            for name, port in ports.items():
                env = {**common, "FANROUTE_PORT": str(port), "FANROUTE_SAMPLER_URL": sampler,
                       "FANROUTE_TOKENIZER": args.base, "FANROUTE_AUTH": "false",
                       "FANROUTE_STREAM_SAMPLER": "true" if name == "decoded" else "false",
                       "FANROUTE_BASE_MODEL_NAME": "base" if args.no_adapter else "policy@1"}
                procs.append(start("services.relay", env, tmp / f"relay-{name}.log"))
                await wait_ready(http, f"http://127.0.0.1:{port}/healthz", procs[-1], f"relay {name}",
                                 tmp / f"relay-{name}.log")
            urls = {name: f"http://127.0.0.1:{port}/tr/{{trace}}/v1/chat/completions" for name, port in ports.items()}
            per_level = args.requests + args.warmup
            queries = [q.text for q in sample_queries(limit=per_level * len(levels), seed=0)]
            bodies = [{"model": "policy", "messages": router_messages(names, q), "max_tokens": args.tokens,
                       "temperature": 0} for q in queries]
            out["results"] = {}
            for n, level in enumerate(levels):
                batch = bodies[n * per_level:(n + 1) * per_level]
                print(f"concurrency {level}: {args.warmup} warm-up + {args.requests} pairs", file=sys.stderr)
                await closed_loop(http, urls, batch[:args.warmup], 1)
                out["results"][str(level)] = await closed_loop(http, urls, batch[args.warmup:], level)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    out["loadavg_after"] = os.getloadavg()
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nrelay streaming, {out['model']}, up to {out['tokens']} greedy tokens, {out['cpus']} CPUs, "
          f"load {out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}")
    print(f"{'conc':>5}{'relay':>9}{'TTFT p50':>10}{'p99':>9}{'total p50':>11}{'p99':>9}{'chunks':>8}")
    for level, r in out["results"].items():
        for name in RELAYS:
            x = r[name]
            print(f"{level:>5}{name:>9}{x['ttft_ms']['p50']:>10.1f}{x['ttft_ms']['p99']:>9.1f}"
                  f"{x['total_ms']['p50']:>11.1f}{x['total_ms']['p99']:>9.1f}{x['content_chunks_mean']:>8.1f}")
        ratio = r["ratio_whole_over_decoded"]
        print(f"{'':>5}{'ratio':>9}  TTFT whole/decoded {ratio['ttft']['p50']:.2f}x (p50), "
              f"{ratio['ttft']['p99']:.2f}x (p99); total {ratio['total']['p50']:.2f}x (p50)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="measured pairs per concurrency")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--concurrency", default="1,4", help="comma-separated closed-loop concurrencies")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per call at most")
    p.add_argument("--market", default="federated")
    p.add_argument("--threads", type=int, default=None, help="the sampler's torch threads")
    p.add_argument("--no-adapter", action="store_true", help="serve the base model, no LoRA")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay_streaming.json")
    return run_and_write(p.parse_args(argv), run, report)


if __name__ == "__main__":
    main()
