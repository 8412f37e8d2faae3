"""Benchmark: what the gateway adds over its slowest provider, beside a plain asyncio fan-out.

Three loopback providers with fixed latencies (SearXNG JSON format) run in their own process;
the gateway runs in its own process (``python -m services.gateway``) with the same three
providers; this process drives load (aiohttp) at a fixed concurrency. In the same run it also
fans out to the same providers with nothing but aiohttp + ``asyncio.gather`` (the baseline).

Added latency per request = round trip − the slowest provider call inside that request (the
gateway reports each candidate's latency; the baseline times its own calls). "handler" is the
gateway's own Server-Timing: time inside the request handler minus the slowest provider, i.e.
without the inbound HTTP and the event-loop queueing that the round trip includes. The gateway is
measured on the in-memory bus and, with ``--kafka``, again on a real broker (acks=all on the request
path, the outbox on: a trace not acked in time is spooled). Each row also gives the CPU milliseconds
each process spent per request (the two cores are shared, so that is where throughput goes) and the
mean encoded trace size from the gateway's ``fanroute_gateway_trace_bytes`` histogram. A second
baseline, ``bench/plain_proxy.py``, is the least a Python proxy process can do (uvicorn, the same three
aiohttp calls, a JSON answer): what separates it from the in-process fan-out is the cost of any proxy
hop on shared cores; what separates the gateway from it is fanroute's own work.

    python bench/gateway_overhead.py --requests 1500 --concurrency 100 --kafka
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
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
sys.path.insert(0, str(ROOT))
from bench.routed_fixture import (  # noqa: E402
    bench_query,
    local_stack_left_as_found,
    publish_and_promote,
    redis_for,
    routed_env,
    start_publisher,
)
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


async def wait_routing(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the gateway at ``url`` follows a promoted router (its /healthz names a version), so no
    request of a routed run falls back for want of one."""
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + timeout_s
        while (await c.get(f"{url}/healthz")).json().get("routing", {}).get("version") is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} follows no promoted router after {timeout_s:g} s")
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


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) a process and its live children have used: ``pid``, or this one alone."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:  # the gateway's workers (FANROUTE_WORKERS > 1) are its children
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return own + sum(cpu_s(int(c)) for c in children)


def profiler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling the gateway process (every thread, native frames off) into a flame graph SVG, or
    into collapsed stacks (one ``frame;frame;... count`` line each) when ``out`` ends in ``.txt``."""
    if shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = "raw" if out.suffix == ".txt" else "flamegraph"
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", fmt,
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL)


def trace_bytes(metrics_text: str) -> float | None:
    """Mean encoded trace size from the gateway's ``fanroute_gateway_trace_bytes`` histogram."""
    got = {}
    for line in metrics_text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"fanroute_gateway_trace_bytes_{part} "):
                got[part] = float(line.split()[1])
    return got["sum"] / got["count"] if got.get("count") else None


def routed_count(metrics_text: str, before: str = "") -> dict[str, float]:
    """Routed requests by path (``router`` / ``fallback``, from ``fanroute_gateway_routed_total``) and
    fallbacks by reason (``fallback:<reason>``), less those already counted in ``before``."""
    from bench.open_loop import counters, metric_delta

    now, then = counters(metrics_text), counters(before)
    paths = metric_delta(then, now, "fanroute_gateway_routed_total", by="path")
    reasons = metric_delta(then, now, "fanroute_gateway_route_fallbacks_total", by="reason")
    return {k: float(v) for k, v in (paths | {f"fallback:{r}": n for r, n in reasons.items()}).items() if v}


def kafka_for(choice: str | None) -> str | None:
    """The broker of the ``--kafka`` run: the given bootstrap, or (``auto``) $KAFKA_BOOTSTRAP_SERVERS,
    else the project's local stack (``python -m devstack up``), started if it is not running."""
    if choice is None:
        return None
    if choice != "auto":
        return choice
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    sys.path.insert(0, str(ROOT))
    import devstack

    return devstack.up(components=("kafka",)).bootstrap_servers


def start_gateway(gport: int, pport: int, latencies: list[float], kafka: str,
                  routed: dict[str, str] | None = None, workers: int = 1) -> subprocess.Popen:
    providers = [{"type": "searxng", "name": f"p{i}", "base_url": f"http://127.0.0.1:{pport}/p{i}",
                  "timeout_s": 5, "max_retries": 0} for i in range(len(latencies))]
    env = {**os.environ, "FANROUTE_PORT": str(gport), "FANROUTE_PROVIDERS": json.dumps(providers),
           "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka, "FANROUTE_LOG_LEVEL": "WARNING",
           "FANROUTE_KAFKA__TOPIC_NAMESPACE": f"bench{gport}.", "FANROUTE_REQUIRE_KAFKA_AT_START": "true",
           "FANROUTE_SPOOL_DIR": f"/tmp/fanroute-bench-spool-{gport}", "FANROUTE_WORKERS": str(workers),
           **(routed or {})}
    return subprocess.Popen([sys.executable, "-m", "services.gateway"], cwd=ROOT, env=env)


async def bench(args: argparse.Namespace) -> dict:
    pport = free_port()
    providers = subprocess.Popen([sys.executable, str(ROOT / "bench" / "synthetic_providers.py"), str(pport),
                                  *map(str, args.latencies), "--snippet-chars", str(args.snippet_chars)])
    base = [("in-memory bus", "memory://")] + ([("Kafka, acks=all", args.broker)] if args.broker else [])
    buses = [("plain Python proxy", None), *base]
    if args.workers > 1:
        buses += [(f"{label}, {args.workers} workers", kafka) for label, kafka in base]
    results: dict[str, dict] = {}
    publisher, routed = None, None
    if args.routed:  # a promoted linear router served in-process: the decision is on the request path
        buses += [(f"routed linear, {label}", kafka) for label, kafka in base]
        pub_port, redis_url = free_port(), redis_for(args.redis)
        pub_store = Path(f"/tmp/fanroute-bench-pub-{pub_port}")
        publisher = start_publisher(pub_port, redis_url, "memory://", pub_store)
        routed = routed_env(f"http://127.0.0.1:{pub_port}", redis_url, args.fanout_fraction)
    try:
        await wait_http(f"http://127.0.0.1:{pport}/p0/search?q=warm")
        if publisher is not None:
            await wait_http(f"{routed['FANROUTE_ROUTING__PUBLISHER_URL']}/healthz")
            names = [f"p{i}" for i in range(len(args.latencies))]
            print("promoted", await asyncio.to_thread(publish_and_promote,
                                                      routed["FANROUTE_ROUTING__PUBLISHER_URL"], names, names[-1]))
        conn = aiohttp.TCPConnector(limit=args.concurrency * 4)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:
            counter = iter(range(10**9))

            async def plain() -> tuple[float, float, float, float]:
                q = bench_query(next(counter), len(args.latencies))

                async def call(i: int) -> float:
                    t = time.perf_counter()
                    async with http.get(f"http://127.0.0.1:{pport}/p{i}/search",
                                        params={"q": q, "format": "json"}) as r:
                        await r.json()
                    return (time.perf_counter() - t) * 1000

                t = time.perf_counter()
                each = await asyncio.gather(*(call(i) for i in range(len(args.latencies))))
                return (time.perf_counter() - t) * 1000 - max(each), float("nan"), 0.0, float("nan")

            await drive(200, args.concurrency, plain)  # warm-up, not measured
            results["plain asyncio fan-out"] = await measure(args, plain, {"providers": providers.pid})
            for label, kafka in buses:
                gport = free_port()
                is_routed = label.startswith("routed")
                workers = args.workers if label.endswith(" workers") else 1
                gateway = (start_gateway(gport, pport, args.latencies, kafka, routed if is_routed else None, workers)
                           if kafka else subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "plain_proxy.py"), str(gport), str(pport),
                     str(len(args.latencies))]))
                try:
                    await wait_http(f"http://127.0.0.1:{gport}/healthz")

                    async def via_gateway(gport: int = gport) -> tuple[float, float, float, float]:
                        q = bench_query(next(counter), len(args.latencies))
                        t = time.perf_counter()
                        async with http.post(f"http://127.0.0.1:{gport}/v1/search", json={"query": q}) as r:
                            r.raise_for_status()
                            body = await r.json()
                            timing = dict(p.strip().split(";dur=") for p in r.headers["Server-Timing"].split(","))
                        total = (time.perf_counter() - t) * 1000
                        spooled = body["trace_status"] == "spooled"  # Kafka did not ack within publish_wait_s
                        route = body.get("route") or {}
                        router_ms = float(route["router_ms"]) if route.get("router") else float("nan")
                        return (total - max(c["latency_ms"] for c in body["candidates"]), float(timing["gateway"]),
                                float(spooled), router_ms)

                    if is_routed:
                        await wait_routing(f"http://127.0.0.1:{gport}")
                    await drive(200, args.concurrency, via_gateway)  # warm-up, not measured
                    before = ""
                    if is_routed:  # count the measured requests' paths only
                        async with http.get(f"http://127.0.0.1:{gport}/metrics") as r:
                            before = await r.text()
                    profile = args.profile if label == "in-memory bus" else None
                    row = await measure(args, via_gateway, {"providers": providers.pid, "gateway": gateway.pid},
                                        profile=profile)
                    if kafka:
                        async with http.get(f"http://127.0.0.1:{gport}/metrics") as r:
                            text = await r.text()
                        row["trace_bytes_mean"] = trace_bytes(text)
                        if is_routed:
                            row["routed_requests"] = routed_count(text, before)
                    results[f"fanroute gateway ({label})" if kafka else label] = row
                finally:
                    gateway.terminate()
                    gateway.wait(timeout=30)
                    shutil.rmtree(f"/tmp/fanroute-bench-spool-{gport}", ignore_errors=True)  # a bench namespace
    finally:
        providers.terminate()
        providers.wait(timeout=10)
        if publisher is not None:
            publisher.terminate()
            publisher.wait(timeout=30)
            shutil.rmtree(pub_store, ignore_errors=True)
    return {"kafka": args.broker, "requests": args.requests, "concurrency": args.concurrency,
            "snippet_chars": args.snippet_chars, "routed_fanout_fraction": args.fanout_fraction if args.routed else None,
            "provider_latencies_ms": args.latencies, "results": results, "cpus": os.cpu_count(),
            "event_loop": os.environ.get("FANROUTE_EVENT_LOOP", "asyncio"),
            "gc": {k.removeprefix("FANROUTE_GC__").lower(): v for k, v in os.environ.items()
                   if k.startswith("FANROUTE_GC__")} or "service defaults", "commit": commit()}


def commit() -> str | None:
    """The measured code's commit (``+`` when its tree has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


async def measure(args: argparse.Namespace, fn, pids: dict[str, int], profile: Path | None = None) -> dict:
    """One measured run of ``fn``: added latency percentiles, req/s, CPU ms per request per process."""
    spy = profiler(pids["gateway"], profile) if profile else None
    before = {**{k: cpu_s(pid) for k, pid in pids.items()}, "driver": cpu_s()}
    added, rps = await drive(args.requests, args.concurrency, fn)
    after = {**{k: cpu_s(pid) for k, pid in pids.items()}, "driver": cpu_s()}
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes the flame graph on SIGINT
        spy.wait(timeout=60)
    a = np.asarray(added)
    decided = a[:, 3][~np.isnan(a[:, 3])]  # the router's decision, on the requests it routed
    router = ({"router_p50_ms": float(np.percentile(decided, 50)), "router_p99_ms": float(np.percentile(decided, 99)),
               "router_decisions": int(decided.size)} if decided.size else {})
    return {**router, "added_p50_ms": float(np.percentile(a[:, 0], 50)), "added_p99_ms": float(np.percentile(a[:, 0], 99)),
            "in_handler_p50_ms": float(np.percentile(a[:, 1], 50)),
            "in_handler_p99_ms": float(np.percentile(a[:, 1], 99)), "throughput_rps": rps,
            "spooled": int(a[:, 2].sum()),  # answered before Kafka acked: kept in the spool, re-published
            # where the two cores went: CPU ms per request in each process
            "cpu_ms_per_request": {k: round((after[k] - before[k]) * 1000 / args.requests, 3) for k in before}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--latencies", type=lambda s: [float(x) for x in s.split(",")],
                   default=DEFAULT_LATENCIES_MS, help="comma-separated fixed provider latencies, ms")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/...)")
    p.add_argument("--snippet-chars", type=int, default=480,
                   help="characters of text per result (480: about the demo market's mean, whose traces are "
                        "≈ 55 KB with seven providers; 16: the short synthetic text of earlier runs)")
    p.add_argument("--kafka", nargs="?", const="auto", default=None, metavar="BOOTSTRAP",
                   help="also measure the gateway on a real broker (acks=all, the outbox on): BOOTSTRAP, or "
                        "without a value $KAFKA_BOOTSTRAP_SERVERS, else the local stack (python -m devstack up)")
    p.add_argument("--routed", action="store_true",
                   help="also measure the gateway in routed mode with a promoted linear router (in-process, "
                        "pulled from a real publisher), on every bus measured; the decision is reported apart")
    p.add_argument("--workers", type=int, default=1,
                   help="also measure the gateway with FANROUTE_WORKERS=N (N processes on one port), on every bus")
    p.add_argument("--fanout-fraction", type=float, default=0.1,
                   help="routed runs: the share of requests that keep fanning out (the gateway's default)")
    p.add_argument("--redis", default="auto", metavar="URL",
                   help="routed runs: the Redis holding the stamps (auto: $REDIS_URL, else the local stack)")
    p.add_argument("--keep-stack", action="store_true",
                   help="leave the local stack running when this run started it (by default it is stopped)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a py-spy flame graph (SVG) of the gateway during its measured run here")
    args = p.parse_args(argv)
    if isinstance(args.latencies, str):
        args.latencies = [float(x) for x in args.latencies.split(",")]
    tag = f"c{args.concurrency}_max{max(args.latencies):g}ms"
    args.out = args.out or ROOT / "bench" / "results" / f"gateway_overhead_{tag}.json"
    with local_stack_left_as_found(keep=args.keep_stack):
        args.broker = kafka_for(args.kafka)
        out = asyncio.run(bench(args))
    r = out["results"]
    base = r["plain asyncio fan-out"]
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, providers {args.latencies} ms")
    print(f"{'':<38}{'added p50':>10}{'added p99':>10}{'hdl p50':>9}{'hdl p99':>9}{'req/s':>8}{'trace B':>9}"
          f"   CPU ms/request")
    for name, v in r.items():
        cpu = " ".join(f"{k} {ms:.2f}" for k, ms in v["cpu_ms_per_request"].items())
        size = f"{v['trace_bytes_mean']:.0f}" if v.get("trace_bytes_mean") else ""
        cpu += f"  (spooled {v['spooled']})" if v["spooled"] else ""
        print(f"{name:<38}{v['added_p50_ms']:>10.2f}{v['added_p99_ms']:>10.2f}{v['in_handler_p50_ms']:>9.2f}"
              f"{v['in_handler_p99_ms']:>9.2f}{v['throughput_rps']:>8.1f}{size:>9}   {cpu}")
    out["ratio"] = {name: {"added_p50": v["added_p50_ms"] / base["added_p50_ms"],
                           "added_p99": v["added_p99_ms"] / base["added_p99_ms"],
                           "throughput": v["throughput_rps"] / base["throughput_rps"]}
                    for name, v in r.items() if name != "plain asyncio fan-out"}
    for name, v in r.items():
        if "router_p50_ms" in v:
            print(f"{name}: router decision p50 {v['router_p50_ms']:.2f} ms, p99 {v['router_p99_ms']:.2f} ms "
                  f"on {v['router_decisions']} routed requests; by path {v.get('routed_requests')}")
    for name, ratio in out["ratio"].items():
        print(f"ratio {name} / plain: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
