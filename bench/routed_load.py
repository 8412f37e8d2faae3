"""Load test: the gateway in routed mode beside the same gateway fanning out, at a fixed open-loop rate.

Three loopback providers (SearXNG JSON, bench/synthetic_providers.py, with a seeded log-normal
latency around the given medians) run in one process; a fake router (bench/fake_router.py: OpenAI
chat completions, log-normal latency, shares of garbage, slow and HTTP 500 answers) in another,
unless ``--router-url`` points at a real one (the CPU sampler serving ``router@N``). The gateway runs
in its own process, started twice in the same run:

* ``fan-out`` (the baseline): routing disabled, every request calls every provider;
* ``routed``: routing enabled with ``router@N`` promoted (Redis key when $REDIS_URL is set, else an
  in-memory stamp store), a deterministic ``--fanout-fraction`` slice still fanning out.

Both sides get the same requests (ids, queries) at the same rate for the same time, after an
unmeasured warm-up. Latency is client-side, from each request's scheduled send time (open loop, so
queueing counts). Fallbacks are read from each response (``route.fallback``) and cross-checked with
the gateway's /metrics (counter deltas over the measured window). Memory is the gateway process's
RSS (psutil, else /proc/PID/status) when ready, when the measured window starts, and at its end.
Kafka: the real broker at $KAFKA_BOOTSTRAP_SERVERS when set, else in-memory.

    python bench/routed_load.py --rate 50 --duration 30
    python bench/routed_load.py --router-url http://127.0.0.1:8001 --router-version 3 --router-timeout 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.fake_router import RouterBehaviour  # noqa: E402
from bench.gateway_overhead import free_port, wait_http  # noqa: E402
from bench.open_loop import Window, counters, hwm_mb, metric_delta, open_loop, pct, psutil, rss_mb  # noqa: E402
from bench.sampler_support import stop  # noqa: E402

DEFAULT_LATENCIES_MS = "20,35,50"
DEFAULTS = {"rate": 50.0, "duration": 30.0}
SIDES = ("fan-out", "routed")
FALLBACK_REASONS = ("no_adapter", "router_timeout", "router_error", "unparseable")


# --------------------------------------------------------------------------- child processes


class LognormalLatencies(Sequence[float]):
    """Provider ``i``'s latency in ms, drawn per call: median ``medians[i]``, log-normal ``sigma``, seeded.

    Handed to :func:`bench.synthetic_providers.make_app` in place of its fixed list."""

    def __init__(self, medians: list[float], sigma: float, seed: int) -> None:
        self.medians, self.sigma = medians, sigma
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.medians)

    def __getitem__(self, i):  # type: ignore[override]
        return float(self.medians[i] * np.exp(self.sigma * self.rng.standard_normal()))


def serve_providers(argv: list[str]) -> None:
    import uvicorn

    from bench.synthetic_providers import make_app

    port, sigma, seed, medians = int(argv[0]), float(argv[1]), int(argv[2]), [float(x) for x in argv[3:]]
    app = make_app(LognormalLatencies(medians, sigma, seed))  # type: ignore[arg-type]
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def serve_gateway(spec: dict[str, Any]) -> None:
    """The gateway as ``python -m services.gateway`` runs it, with the promotion written first."""
    from services.common.entry import serve_app
    from services.common.logging import setup_logging
    from services.common.stamps import MemoryStampStore, RedisStampStore
    from services.gateway.app import build_gateway, create_app
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(**spec["settings"])
    setup_logging(settings.log_level)
    stamps = None  # with a real Redis the gateway reads the key with its own client
    if (promote := spec.get("promote")) is not None:
        writer = (MemoryStampStore() if settings.redis.url == "memory://"
                  else RedisStampStore(settings.redis.url, settings.kafka.topic_namespace))
        await writer.set_promoted(settings.routing.model_id, promote["version"], promote["fallback_provider"])
        if isinstance(writer, MemoryStampStore):
            stamps = writer
        else:  # where the publisher writes it
            await writer.close()
    await serve_app(create_app(settings, gateway=build_gateway(settings, stamps=stamps)), settings)


# --------------------------------------------------------------------------- one side


def _child_env() -> dict[str, str]:
    """This environment minus FANROUTE_* (the gateway's settings come from the spec alone)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FANROUTE_")}


async def run_side(side: str, args: argparse.Namespace, pport: int, router_url: str | None) -> dict[str, Any]:
    routed = side == "routed"
    gport = free_port()
    ns = f"bench{gport}."
    providers = [{"type": "searxng", "name": f"p{i}", "base_url": f"http://127.0.0.1:{pport}/p{i}",
                  "timeout_s": 5, "max_retries": 0} for i in range(len(args.latencies))]
    routing: dict[str, Any] = {"enabled": False}
    if routed:
        routing = {"enabled": True, "router_url": router_url, "model_id": "router", "mode": "generate",
                   "fanout_fraction": args.fanout_fraction, "router_timeout_s": args.router_timeout,
                   "max_tokens": args.max_tokens, "fallback_provider": args.fallback_provider,
                   "poll_s": 5.0, "group_id": f"bench-routed-{gport}"}
    spec = {"settings": {"host": "127.0.0.1", "port": gport, "providers": providers, "log_level": "WARNING",
                         "kafka": {"bootstrap_servers": args.kafka, "topic_namespace": ns},
                         "redis": {"url": args.redis}, "routing": routing},
            "promote": {"version": args.router_version, "fallback_provider": args.fallback_provider}
            if routed else None}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"routed_load_{side}_", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), "_gateway", json.dumps(spec)], cwd=ROOT,
                            env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{gport}"
    say = lambda msg: print(f"[{side}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        await _wait_gateway(proc, f"{base}/healthz", log.name)
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            if routed:
                await _wait_promoted(http, base, f"router@{args.router_version}")
            mem = {"ready": rss_mb(proc.pid)}
            if args.warmup > 0:
                say(f"warm-up {args.warmup:g} s at {args.rate:g}/s")
                await open_loop(http, f"{base}/v1/search", "warm", args.rate, args.warmup,
                                args.request_timeout, Window())
            metrics0 = counters(await (await http.get(f"{base}/metrics")).text())
            router0 = await _router_stats(http, router_url) if args.router_url is None and routed else None
            mem["start"] = rss_mb(proc.pid)
            win = Window()
            seen_rss = [mem["start"]]
            next_at = [args.progress]

            def progress(t: float, inflight: int) -> None:
                if t < next_at[0]:
                    return
                next_at[0] += args.progress
                seen_rss.append(rss_mb(proc.pid))
                lat = pct(win.latencies())
                errs = sum(not r["ok"] for r in win.rows)
                say(f"{t:5.1f}s sent {win.sent} done {len(win.rows)} in flight {inflight} errors {errs} "
                    f"p50 {lat['p50'] or 0:.1f} p99 {lat['p99'] or 0:.1f} ms, rss {seen_rss[-1]:.1f} MB")

            say(f"measuring {args.duration:g} s at {args.rate:g}/s")
            await open_loop(http, f"{base}/v1/search", "load", args.rate, args.duration,
                                      args.request_timeout, win, progress)
            mem["end"] = rss_mb(proc.pid)
            seen_rss.append(mem["end"])
            metrics1 = counters(await (await http.get(f"{base}/metrics")).text())
            router1 = await _router_stats(http, router_url) if router0 is not None else None
        mem.update(growth=mem["end"] - mem["start"], peak_sampled=max(seen_rss), hwm=hwm_mb(proc.pid))
    finally:
        stop(proc, 15.0)
        if routed and args.redis != "memory://":
            await _forget_promotion(args.redis, ns)
    log_lines = Path(log.name).read_text().splitlines()
    log.close()
    os.unlink(log.name)
    out = summarise(win, metrics0, metrics1, mem)
    out["gateway_log"] = {"warnings": sum(" WARNING " in ln for ln in log_lines),
                          "errors": [ln for ln in log_lines if " ERROR " in ln or "Traceback" in ln][:5]}
    if router0 is not None:
        out["fake_router"] = {k: router1.get(k, 0) - router0.get(k, 0)
                              for k in ("requests", "ok", "bad", "slow", "error")}
    return out


async def _wait_gateway(proc: subprocess.Popen, url: str, log_path: str, timeout_s: float = 120.0) -> None:
    """Until the gateway answers; a gateway that exits or never answers is an error with its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await wait_http(url, timeout_s=1.0)
            return
        except TimeoutError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway did not come up (exit code {proc.poll()}); its log {log_path}:\n"
                               f"{Path(log_path).read_text()[-3000:]}")


async def _wait_promoted(http: aiohttp.ClientSession, base: str, router: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(f"{base}/healthz") as r:
            routing = (await r.json()).get("routing") or {}
        if routing.get("router") == router:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"routed gateway does not follow {router} after {timeout_s:g}s: {routing}")
        await asyncio.sleep(0.2)


async def _router_stats(http: aiohttp.ClientSession, router_url: str | None) -> dict[str, Any]:
    async with http.get(f"{router_url}/stats") as r:
        return await r.json()


async def _forget_promotion(redis_url: str, ns: str) -> None:
    from redis.asyncio import Redis

    from services.common.stamps import promoted_key

    client = Redis.from_url(redis_url)
    try:
        await client.delete(promoted_key(ns, "router"))
    finally:
        await client.aclose()


def summarise(win: Window, m0: dict, m1: dict, mem: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in win.rows if r["ok"]]
    modes = Counter(r["mode"] for r in ok)
    fallbacks = Counter(r["fallback"] for r in ok if r["mode"] == "routed" and r["fallback"])
    paths = Counter("fallback" if r["fallback"] else "router" for r in ok if r["mode"] == "routed")
    calls = Counter(p for r in ok for p in r["calls"])
    n_calls = sum(calls.values())
    from_metrics = {
        "requests_by_mode": metric_delta(m0, m1, "fanroute_gateway_requests_total", "mode"),
        "routed_by_path": metric_delta(m0, m1, "fanroute_gateway_routed_total", "path"),
        "fallbacks": metric_delta(m0, m1, "fanroute_gateway_route_fallbacks_total", "reason"),
        "provider_calls": metric_delta(m0, m1, "fanroute_provider_calls_total"),
        "failovers": metric_delta(m0, m1, "fanroute_gateway_route_failovers_total"),
        "traces_unpublished": metric_delta(m0, m1, "fanroute_traces_unpublished_total"),
    }
    mismatch = []
    for reason in FALLBACK_REASONS:
        if fallbacks.get(reason, 0) != from_metrics["fallbacks"].get(reason, 0):  # type: ignore[union-attr]
            mismatch.append(f"fallback {reason}: bodies {fallbacks.get(reason, 0)}, "
                            f"metrics {from_metrics['fallbacks'].get(reason, 0)}")  # type: ignore[union-attr]
    for mode in ("routed", "fanout"):
        if modes.get(mode, 0) != from_metrics["requests_by_mode"].get(mode, 0):  # type: ignore[union-attr]
            mismatch.append(f"mode {mode}: bodies {modes.get(mode, 0)}, "
                            f"metrics {from_metrics['requests_by_mode'].get(mode, 0)}")  # type: ignore[union-attr]
    if n_calls != from_metrics["provider_calls"]:
        mismatch.append(f"provider calls: bodies {n_calls}, metrics {from_metrics['provider_calls']}")
    errors = Counter(r["error"] for r in win.rows if not r["ok"])
    return {
        "requests": len(win.rows), "ok": len(ok), "errors": sum(errors.values()), "error_kinds": dict(errors),
        "unpublished": sum(not r["published"] for r in ok),
        "offered_rate": (win.sent - 1) / win.send_s if win.send_s else None, "window_s": win.window_s,
        "max_send_lag_ms": win.max_lag_ms,
        "latency_ms": pct(win.latencies()),
        "latency_ms_by_mode": {m: pct(win.latencies(m)) for m in sorted(modes)},
        "routed_latency_ms_by_outcome": {k: pct([r["ms"] for r in ok if r["mode"] == "routed"
                                                 and (r["fallback"] or "router") == k])
                                         for k in ("router", *FALLBACK_REASONS) if k == "router" or fallbacks[k]},
        "modes": dict(modes), "routed_by_path": dict(paths),
        "fallbacks": {k: fallbacks.get(k, 0) for k in FALLBACK_REASONS},
        "router_ms": pct([r["router_ms"] for r in ok if r.get("router_ms")]),
        "provider_calls_per_request": n_calls / len(ok) if ok else None,
        "calls_by_provider": dict(sorted(calls.items())),
        "metrics": from_metrics, "metrics_agree": not mismatch, "metrics_mismatch": mismatch,
        "memory_mb": mem,
    }


# --------------------------------------------------------------------------- the run


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    pport = free_port()
    procs = [subprocess.Popen([sys.executable, str(Path(__file__)), "_providers", str(pport),
                               str(args.provider_sigma), str(args.seed), *map(str, args.latencies)], cwd=ROOT)]
    behaviour = None
    router_url = args.router_url
    if router_url is None:
        rport = free_port()
        behaviour = RouterBehaviour(median_ms=args.router_median_ms, sigma=args.router_sigma, bad=args.router_bad,
                                    slow=args.router_slow, slow_ms=args.router_slow_ms, error=args.router_error,
                                    seed=args.seed)
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "fake_router.py"), str(rport),
             "--median-ms", str(behaviour.median_ms), "--sigma", str(behaviour.sigma), "--bad", str(behaviour.bad),
             "--slow", str(behaviour.slow), "--slow-ms", str(behaviour.slow_ms), "--error", str(behaviour.error),
             "--seed", str(args.seed)], cwd=ROOT))
        router_url = f"http://127.0.0.1:{rport}"
    router_url = router_url.rstrip("/")
    try:
        await wait_http(f"http://127.0.0.1:{pport}/p0/search?q=warm")
        await wait_http(f"{router_url}/v1/models")
        results = {}
        for side in SIDES:
            results[side] = await run_side(side, args, pport, router_url)
    finally:
        for p in procs:
            stop(p, 10.0)
    return {"kafka": args.kafka, "redis": args.redis, "rate": args.rate, "duration_s": args.duration,
            "warmup_s": args.warmup, "fanout_fraction": args.fanout_fraction,
            "router": {"kind": "fake" if behaviour else "real", "url": router_url, "version": args.router_version,
                       "timeout_s": args.router_timeout, "max_tokens": args.max_tokens,
                       "behaviour": behaviour.__dict__ if behaviour else None,
                       "describe": behaviour.describe() if behaviour else router_url},
            "providers": {"median_ms": args.latencies, "sigma": args.provider_sigma},
            "fallback_provider": args.fallback_provider, "seed": args.seed, "cpus": os.cpu_count(),
            "memory_source": "psutil" if psutil is not None else "/proc/PID/status", "results": results}


def ratios(out: dict[str, Any]) -> dict[str, float | None]:
    base, routed = out["results"]["fan-out"], out["results"]["routed"]

    def div(a, b):
        return a / b if a is not None and b else None

    return {"p50": div(routed["latency_ms"]["p50"], base["latency_ms"]["p50"]),
            "p99": div(routed["latency_ms"]["p99"], base["latency_ms"]["p99"]),
            "calls_per_request": div(routed["provider_calls_per_request"], base["provider_calls_per_request"])}


def print_summary(out: dict[str, Any]) -> None:
    r = out["results"]
    n = round(out["rate"] * out["duration_s"])
    print(f"\n{n} requests per side at {out['rate']:g}/s for {out['duration_s']:g} s (open loop, after "
          f"{out['warmup_s']:g} s warm-up), kafka={out['kafka']}, redis={out['redis']}, {out['cpus']} cpus")
    print(f"providers {out['providers']['median_ms']} ms (median, sigma {out['providers']['sigma']:g}); "
          f"router {out['router']['describe']}, timeout {out['router']['timeout_s']:g} s; "
          f"fan-out slice {out['fanout_fraction']:.0%}")
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'':<9}{'reqs':>6}{'ok':>6}{'err':>5}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'calls/req':>10}"
          f"{'routed':>8}{'fanout':>8}{'fallbk':>8}{'rss start':>10}{'end':>8}{'growth':>8}")
    for side, v in r.items():
        m = v["memory_mb"]
        print(f"{side:<9}{v['requests']:>6}{v['ok']:>6}{v['errors']:>5}{f(v['latency_ms']['p50']):>9}"
              f"{f(v['latency_ms']['p99']):>9}{f(v['latency_ms']['max']):>9}"
              f"{f(v['provider_calls_per_request'], '.2f'):>10}"
              f"{v['modes'].get('routed', 0):>8}{v['modes'].get('fanout', 0):>8}{sum(v['fallbacks'].values()):>8}"
              f"{m['start']:>10.1f}{m['end']:>8.1f}{m['growth']:>+8.1f}")
    routed = r["routed"]
    by_mode = routed["latency_ms_by_mode"]
    print("routed side by mode: " + "; ".join(f"{k} n={v['n']} p50 {f(v['p50'])} p99 {f(v['p99'])} ms"
                                              for k, v in by_mode.items())
          + f"; router answer p50 {f(routed['router_ms']['p50'])} p99 {f(routed['router_ms']['p99'])} ms")
    print("routed requests by outcome: " + "; ".join(f"{k} n={v['n']} p50 {f(v['p50'])} p99 {f(v['p99'])} ms"
                                                     for k, v in routed["routed_latency_ms_by_outcome"].items()))
    print("fallbacks (bodies/metrics): " + ", ".join(
        f"{k} {routed['fallbacks'][k]}/{routed['metrics']['fallbacks'].get(k, 0)}" for k in FALLBACK_REASONS)
        + f"; failovers {routed['metrics']['failovers']}")
    if "fake_router" in routed:
        print("fake router saw: " + ", ".join(f"{k} {v}" for k, v in routed["fake_router"].items()))
    for side, v in r.items():
        if not v["metrics_agree"]:
            print(f"WARNING {side}: responses and /metrics disagree: {'; '.join(v['metrics_mismatch'])}")
        if v["errors"]:
            print(f"{side} errors: {v['error_kinds']}")
        if v["gateway_log"]["errors"]:
            print(f"{side} gateway logged errors, e.g. {v['gateway_log']['errors'][0]}")
    print("ratio routed/fan-out: " + ", ".join(f"{k} {f(v, '.2f')}x" for k, v in out["ratio"].items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"], help="requests per second (open loop)")
    p.add_argument("--duration", type=float, default=DEFAULTS["duration"], help="measured seconds per side")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds per side before measuring")
    p.add_argument("--latencies", default=DEFAULT_LATENCIES_MS,
                   help="comma-separated provider median latencies, ms (providers p0, p1, ...)")
    p.add_argument("--provider-sigma", type=float, default=0.3, help="provider latency log-normal shape")
    p.add_argument("--fanout-fraction", type=float, default=0.1, help="share that keeps fanning out (routed side)")
    p.add_argument("--fallback-provider", default="p0", help="best single provider (routed side)")
    p.add_argument("--router-url", default=None, help="a real OpenAI-compatible router (default: the fake one)")
    p.add_argument("--router-version", type=int, default=1, help="promoted version: the gateway asks router@N")
    p.add_argument("--router-timeout", type=float, default=None,
                   help="router deadline, s (default 0.5 with the fake router, 5 with a real one)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--router-median-ms", type=float, default=RouterBehaviour.median_ms, help="fake router")
    p.add_argument("--router-sigma", type=float, default=RouterBehaviour.sigma, help="fake router")
    p.add_argument("--router-bad", type=float, default=RouterBehaviour.bad, help="fake router: garbage share")
    p.add_argument("--router-slow", type=float, default=RouterBehaviour.slow,
                   help="fake router: share answered after --router-slow-ms (past the deadline)")
    p.add_argument("--router-slow-ms", type=float, default=RouterBehaviour.slow_ms, help="fake router")
    p.add_argument("--router-error", type=float, default=RouterBehaviour.error, help="fake router: HTTP 500 share")
    p.add_argument("--request-timeout", type=float, default=30.0, help="client timeout per request, s")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/routed_load*.json)")
    args = p.parse_args(argv)
    args.latencies = [float(x) for x in args.latencies.split(",")]
    if args.router_timeout is None:
        args.router_timeout = 0.5 if args.router_url is None else 5.0
    args.kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "memory://")
    args.redis = os.environ.get("REDIS_URL", "memory://")
    if args.out is None:
        tag = [f"r{args.rate:g}"] if args.rate != DEFAULTS["rate"] else []
        tag += [f"d{args.duration:g}s"] if args.duration != DEFAULTS["duration"] else []
        tag += ["kafka"] if args.kafka != "memory://" else []
        tag += ["realrouter"] if args.router_url else []
        args.out = ROOT / "bench" / "results" / ("_".join(["routed_load", *tag]) + ".json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_providers"]:
        serve_providers(argv[1:])
        return None
    if argv[:1] == ["_gateway"]:
        asyncio.run(serve_gateway(json.loads(argv[1])))
        return None
    args = parse_args(argv)
    out = asyncio.run(bench(args))
    out["ratio"] = ratios(out)
    print_summary(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
