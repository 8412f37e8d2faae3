"""Benchmark: what the gateway adds over its slowest provider, beside a plain asyncio fan-out.

Three loopback providers with fixed latencies (SearXNG JSON format) run in their own process;
the gateway runs in its own process (``python -m services.gateway``) with the same three
providers; this process drives load (aiohttp) at a fixed concurrency. In the same run it also
fans out to the same providers with nothing but aiohttp + ``asyncio.gather`` (the baseline).

Added latency per request = round trip − the slowest provider call inside that request (the
gateway reports each candidate's latency; the baseline times its own calls). "handler" is the
gateway's own Server-Timing: time inside the request handler minus the slowest provider, i.e.
without the inbound HTTP and the event-loop queueing that the round trip includes. Kafka: the real
broker at $KAFKA_BOOTSTRAP_SERVERS when set (acks=all, on the request path), else in-memory.

    python bench/gateway_overhead.py --requests 2000 --concurrency 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LATENCIES_MS = "20,35,50"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_http(url: str, timeout_s: float = 120.0) -> None:
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await c.get(url)).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not come up")
            await asyncio.sleep(0.1)


async def drive(n: int, concurrency: int, one) -> tuple[list[float], float]:
    """Run ``one()`` n times, ``concurrency`` at once; returns added-latency samples and req/s."""
    sem = asyncio.Semaphore(concurrency)
    added: list = []
    bar = tqdm(total=n, unit="req", leave=False)

    async def task() -> None:
        async with sem:
            added.append(await one())
            bar.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(task() for _ in range(n)))
    elapsed = time.perf_counter() - t0
    bar.close()
    return added, n / elapsed


def profiler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling the gateway process (every thread, native frames off) into a flame graph SVG."""
    if shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "flamegraph",
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL)


async def bench(args: argparse.Namespace) -> dict:
    pport, gport = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench" / "synthetic_providers.py"), str(pport),
                               *map(str, args.latencies)])]
    kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "memory://")
    providers = [{"type": "searxng", "name": f"p{i}", "base_url": f"http://127.0.0.1:{pport}/p{i}",
                  "timeout_s": 5, "max_retries": 0} for i in range(len(args.latencies))]
    env = {**os.environ, "FANROUTE_PORT": str(gport), "FANROUTE_PROVIDERS": json.dumps(providers),
           "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka, "FANROUTE_LOG_LEVEL": "WARNING",
           "FANROUTE_KAFKA__TOPIC_NAMESPACE": f"bench{gport}."}
    procs.append(subprocess.Popen([sys.executable, "-m", "services.gateway"], cwd=ROOT, env=env))
    try:
        await wait_http(f"http://127.0.0.1:{pport}/p0/search?q=warm")
        await wait_http(f"http://127.0.0.1:{gport}/healthz")
        conn = aiohttp.TCPConnector(limit=args.concurrency * 4)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:
            counter = iter(range(10**9))

            async def via_gateway() -> float:
                q = f"query {next(counter)}"
                t = time.perf_counter()
                async with http.post(f"http://127.0.0.1:{gport}/v1/search", json={"query": q}) as r:
                    r.raise_for_status()
                    body = await r.json()
                    timing = dict(p.strip().split(";dur=") for p in r.headers["Server-Timing"].split(","))
                total = (time.perf_counter() - t) * 1000
                if body["trace_status"] != "published":
                    raise RuntimeError(f"trace {body['trace_status']}, not published")
                return total - max(c["latency_ms"] for c in body["candidates"]), float(timing["gateway"])

            async def plain() -> float:
                q = f"query {next(counter)}"

                async def call(i: int) -> float:
                    t = time.perf_counter()
                    async with http.get(f"http://127.0.0.1:{pport}/p{i}/search",
                                        params={"q": q, "format": "json"}) as r:
                        await r.json()
                    return (time.perf_counter() - t) * 1000

                t = time.perf_counter()
                each = await asyncio.gather(*(call(i) for i in range(len(args.latencies))))
                return (time.perf_counter() - t) * 1000 - max(each), float("nan")

            await drive(200, args.concurrency, via_gateway)  # warm-up, not measured
            await drive(200, args.concurrency, plain)
            results = {}
            for name, fn in (("plain asyncio fan-out", plain), ("fanroute gateway", via_gateway)):
                spy = profiler(procs[1].pid, args.profile) if args.profile and fn is via_gateway else None
                added, rps = await drive(args.requests, args.concurrency, fn)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes the flame graph on SIGINT
                    spy.wait(timeout=60)
                a = np.asarray(added)
                results[name] = {"added_p50_ms": float(np.percentile(a[:, 0], 50)),
                                 "added_p99_ms": float(np.percentile(a[:, 0], 99)),
                                 "in_handler_p50_ms": float(np.percentile(a[:, 1], 50)),
                                 "in_handler_p99_ms": float(np.percentile(a[:, 1], 99)),
                                 "throughput_rps": rps}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    return {"kafka": kafka, "requests": args.requests, "concurrency": args.concurrency,
            "provider_latencies_ms": args.latencies, "results": results, "cpus": os.cpu_count()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--latencies", type=lambda s: [float(x) for x in s.split(",")],
                   default=DEFAULT_LATENCIES_MS, help="comma-separated fixed provider latencies, ms")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/...)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a py-spy flame graph (SVG) of the gateway during its measured run here")
    args = p.parse_args()
    if isinstance(args.latencies, str):
        args.latencies = [float(x) for x in args.latencies.split(",")]
    tag = f"c{args.concurrency}_max{max(args.latencies):g}ms"
    args.out = args.out or ROOT / "bench" / "results" / f"gateway_overhead_{tag}.json"
    out = asyncio.run(bench(args))
    r = out["results"]
    base, gw = r["plain asyncio fan-out"], r["fanroute gateway"]
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, providers {args.latencies} ms, "
          f"kafka={out['kafka']}")
    print(f"{'':<24}{'added p50 ms':>14}{'added p99 ms':>14}{'handler p50':>13}{'handler p99':>13}"
          f"{'req/s':>10}")
    for name, v in r.items():
        print(f"{name:<24}{v['added_p50_ms']:>14.2f}{v['added_p99_ms']:>14.2f}{v['in_handler_p50_ms']:>13.2f}"
              f"{v['in_handler_p99_ms']:>13.2f}{v['throughput_rps']:>10.1f}")
    out["ratio"] = {"added_p50": gw["added_p50_ms"] / base["added_p50_ms"],
                    "added_p99": gw["added_p99_ms"] / base["added_p99_ms"],
                    "throughput": gw["throughput_rps"] / base["throughput_rps"]}
    print("ratio gateway/plain: " + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratio"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
