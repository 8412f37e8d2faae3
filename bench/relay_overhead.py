"""Benchmark: what the relay adds to a call, against calling the sampler's completions with the same ids.

The CPU sampler (``python -m services.sampler``) serves SmolLM2-135M-Instruct with a freshly initialised
LoRA adapter as ``policy@1`` (r=8, alpha=16, q/k/v/o; ``--no-adapter``: the base), and the relay
(``python -m services.relay``) sits in front of it, each in its own process, the relay with the real
Kafka broker and Redis when ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` are set (it publishes every
``Call`` record with acks=all before answering; otherwise ``memory://``). Every request is the router's
conversation for one of the collections' queries (``sample_queries(seed=0)``), greedy, ``--tokens``
tokens, in its own episode (a credential minted for each through the admin route, before timing):

* ``relay``: ``POST /tr/<trace>/v1/chat/completions`` with the messages, as the OpenAI SDK sends them;
* ``direct``: ``POST /v1/completions`` to the sampler with the token ids the relay renders for those
  messages (rendered here with the same renderer), ``return_token_ids`` and ``logprobs=0``, exactly
  the body the relay sends.

The two alternate request by request (which goes first alternates too), closed loop at each
concurrency; both sample the same tokens (checked: same text). Reported: p50/p99 of each, the ratio
relay/direct, the paired added latency (relay - direct of the same query), and whether the target
(relay ≤ 1.05 × direct + 2 ms, at p50 and at p99) holds; JSON in bench/results/relay_overhead.json.

    python bench/relay_overhead.py --requests 200 --concurrency 1,4
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
import numpy as np

from bench.sampler_support import LORA, fresh_adapter, pct, start, wait_ready  # noqa: F401 - re-exported

ADMIN = "bench-admin-" + uuid.uuid4().hex


async def one(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as r:
        data = await r.json()
        assert r.status == 200, data
    return (time.perf_counter() - t0) * 1e3, data


async def closed_loop(http, relay: str, sampler: str, cases: list[dict[str, Any]], level: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = {"relay": [], "direct": []}
    added: list[float] = []
    queue = list(enumerate(cases))
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue:
            i, c = queue.pop(0)

            async def via_relay() -> tuple[float, str]:
                ms, data = await one(http, f"{relay}/tr/{c['trace']}/v1/chat/completions", c["chat"],
                                     {"authorization": f"Bearer {c['token']}"})
                return ms, data["choices"][0]["message"]["content"]

            async def direct() -> tuple[float, str]:
                ms, data = await one(http, f"{sampler}/v1/completions", c["completion"], {})
                return ms, data["choices"][0]["text"]

            order = (via_relay, direct) if i % 2 == 0 else (direct, via_relay)
            (a_ms, a_text), (b_ms, b_text) = [await f() for f in order]
            r_ms, d_ms = (a_ms, b_ms) if i % 2 == 0 else (b_ms, a_ms)
            assert a_text == b_text, (a_text, b_text)
            lat["relay"].append(r_ms)
            lat["direct"].append(d_ms)
            added.append(r_ms - d_ms)

    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - t0
    out = {k: pct(v) for k, v in lat.items()}
    out["added"] = pct(added)
    out["ratio"] = {q: out["relay"][q] / out["direct"][q] for q in ("p50", "p99")}
    out["target_met"] = {q: out["relay"][q] <= 1.05 * out["direct"][q] + 2.0 for q in ("p50", "p99")}
    out["pairs_per_s"] = len(cases) / wall
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from services.common.prompt import router_messages
    from services.providers.collections import sample_queries
    from services.providers.markets import market
    from services.relay.render import Renderer
    from services.relay.sampling import completion_body
    from services.relay.wire_openai import parse
    from services.tools.serving import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    kafka, redis = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("REDIS_URL")
    sport, rport = free_port(), free_port()
    common = {"FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka or "memory://", "FANROUTE_REDIS__URL": redis or "memory://",
              "FANROUTE_KAFKA__TOPIC_NAMESPACE": f"bench{uuid.uuid4().hex[:8]}.", "FANROUTE_LOG_LEVEL": "WARNING"}
    if args.threads:
        common["FANROUTE_THREADS"] = str(args.threads)
    sampler_env = {**common, "FANROUTE_PORT": str(sport), "FANROUTE_BASE_MODEL": args.base,
                   "FANROUTE_SERVED_MODEL_NAME": "base", "FANROUTE_CONSUME_ADAPTERS": "false",
                   "FANROUTE_ADAPTER_CACHE_DIR": str(tmp / "cache")}
    relay_env = {**common, "FANROUTE_PORT": str(rport), "FANROUTE_SAMPLER_URL": f"http://127.0.0.1:{sport}",
                 "FANROUTE_TOKENIZER": args.base, "FANROUTE_ADMIN_TOKEN": ADMIN,
                 "FANROUTE_BASE_MODEL_NAME": "base" if args.no_adapter else "policy@1"}
    procs = [start("services.sampler", sampler_env, tmp / "sampler.log")]
    names = [p.name for p in market(args.market)]
    levels = [int(c) for c in args.concurrency.split(",")]
    out: dict[str, Any] = {"model": args.base, "adapter": None if args.no_adapter else {"kind": "fresh LoRA", **LORA},
                           "tokens": args.tokens, "requests": args.requests, "warmup": args.warmup,
                           "concurrency": levels, "kafka": kafka or "memory://", "redis": redis or "memory://",
                           "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    sampler, relay = f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{rport}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            # built before the wait: a pooled keep-alive connection must not sit idle past uvicorn's timeout
            path = None if args.no_adapter else fresh_adapter(args.base, tmp / "policy")
            await wait_ready(http, f"{sampler}/health", procs[0], "sampler", tmp / "sampler.log")
            if path is not None:
                async with http.post(f"{sampler}/v1/load_lora_adapter",
                                     json={"lora_name": "policy@1", "lora_path": str(path)}) as r:
                    assert r.status == 200, await r.text()
            procs.append(start("services.relay", relay_env, tmp / "relay.log"))
            await wait_ready(http, f"{relay}/healthz", procs[1], "relay", tmp / "relay.log")
            renderer = Renderer(AutoTokenizer.from_pretrained(args.base))
            model = "base" if args.no_adapter else "policy@1"
            per_level = args.requests + args.warmup
            queries = [q.text for q in sample_queries(limit=per_level * len(levels), seed=0)]
            cases = []
            for q in queries:
                chat = {"model": "policy", "messages": router_messages(names, q), "max_tokens": args.tokens,
                        "temperature": 0}
                req = parse(chat, default_max_tokens=args.tokens, max_tokens_limit=4096, max_stop=16)
                ids = renderer.encode(renderer.text(req.messages))
                trace = f"bench-{uuid.uuid4().hex[:12]}"
                async with http.post(f"{relay}/admin/v1/credentials", json={"trace_id": trace},
                                     headers={"authorization": f"Bearer {ADMIN}"}) as r:
                    token = (await r.json())["token"]
                cases.append({"trace": trace, "token": token, "chat": chat,
                              "completion": completion_body(model, ids, req.sampling)})
            out["prompt_tokens_mean"] = float(np.mean([len(c["completion"]["prompt"]) for c in cases]))
            out["results"] = {}
            for n, level in enumerate(levels):
                batch = cases[n * per_level:(n + 1) * per_level]
                print(f"concurrency {level}: {args.warmup} warm-up + {args.requests} pairs", file=sys.stderr)
                await closed_loop(http, relay, sampler, batch[:args.warmup], 1)
                out["results"][str(level)] = await closed_loop(http, relay, sampler, batch[args.warmup:], level)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    out["loadavg_after"] = os.getloadavg()
    if kafka:  # the relay's own timings, from the Call records it published
        from schemas import Call, topic
        from services.common.replay_topic import read_topic
        from services.common.settings import KafkaSettings

        ks = KafkaSettings(bootstrap_servers=kafka, topic_namespace=common["FANROUTE_KAFKA__TOPIC_NAMESPACE"])
        calls = [c async for c in read_topic(ks, topic("calls"), model=Call)]
        out["relay_side"] = {"calls": len(calls), "render_ms": pct([c.timings.render_ms for c in calls]),
                             "handler_minus_sampler_ms": pct([c.timings.total_ms - c.timings.sample_ms
                                                              for c in calls])}
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nrelay overhead, {out['model']}, {out['tokens']} greedy tokens, prompt {out['prompt_tokens_mean']:.0f} "
          f"tokens on average, kafka {out['kafka']}, redis {out['redis']}, {out['cpus']} CPUs, "
          f"load {out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}")
    print(f"{'conc':>5}{'direct p50':>12}{'p99':>9}{'relay p50':>11}{'p99':>9}{'ratio p50':>11}{'p99':>7}"
          f"{'added p50':>11}{'p99':>8}  target (<= 1.05x + 2 ms)")
    for level, r in out["results"].items():
        met = "met" if all(r["target_met"].values()) else f"NOT met ({r['target_met']})"
        print(f"{level:>5}{r['direct']['p50']:>12.1f}{r['direct']['p99']:>9.1f}{r['relay']['p50']:>11.1f}"
              f"{r['relay']['p99']:>9.1f}{r['ratio']['p50']:>10.3f}x{r['ratio']['p99']:>6.3f}x"
              f"{r['added']['p50']:>11.2f}{r['added']['p99']:>8.2f}  {met}")
    if "relay_side" in out:
        side = out["relay_side"]
        print(f"relay side ({side['calls']} Call records): render p50 {side['render_ms']['p50']:.2f} ms, "
              f"p99 {side['render_ms']['p99']:.2f} ms; handler minus sampler (before the Kafka publish) p50 "
              f"{side['handler_minus_sampler_ms']['p50']:.2f} ms, p99 {side['handler_minus_sampler_ms']['p99']:.2f} ms")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="measured pairs per concurrency")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--concurrency", default="1,4", help="comma-separated closed-loop concurrencies")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per call")
    p.add_argument("--market", default="federated")
    p.add_argument("--threads", type=int, default=None, help="the sampler's torch threads")
    p.add_argument("--no-adapter", action="store_true", help="serve the base model, no LoRA")
    p.add_argument("--base", default=None, help="model dir (default: the prepared SmolLM2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay_overhead.json")
    return run_and_write(p.parse_args(argv), run, report)


def run_and_write(args: argparse.Namespace, run: Any, report: Any) -> dict[str, Any]:
    """The prepared SmolLM2 unless ``--base`` names a model; ``run(args)``, its report, its JSON at ``--out``."""
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
