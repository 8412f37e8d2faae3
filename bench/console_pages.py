"""Benchmark: the console's trace list (a page of 50) with 10,000 traces stored, beside 1,000 in the same run.

Synthetic but schema-valid records go into the console's real store (``ConsoleStore``, SQLite on disk)
through its follower's path (``ingest``: batches with their topic offsets, one transaction each): fan-out
traces of the bundled collections' judged queries over the demo market's seven providers (ten citations
each, 480-character snippets, about the gateway's traces), a quarter contested, one in ``--routed``
routed, an ok verdict on ``--judged`` of them and a review on one verdict in twenty. Then the real app
(``create_app`` on the in-memory bus, driven through httpx's ASGI transport, so the figure is the app's
own: routing, the store's queries and the Jinja2 render, no socket) answers ``GET /traces`` for each
case, ``--requests`` times after ``--warmup``:

* ``all``: the first page, unfiltered;  ``contested``: ``?contested=true``;
* ``provider``: ``?provider=<one of the seven>``;  ``text``: ``?q=<a word of the queries>``;
* ``deep``: the last unfiltered page (the largest OFFSET).

Each size gets its own store in a fresh directory; the process's RSS is read after each ingest and
after each size's requests (``/proc``: VmRSS, and VmHWM the peak). Reported: p50/p95/p99 per case and
size, the ratio 10k/1k per case, whether p95 ≤ 300 ms at the large size (the issue's target), the
store's size on disk; JSON in bench/results/console_pages.json.

    python bench/console_pages.py --traces 10000 --baseline 1000 --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx
import numpy as np

from schemas.base import content_id
from schemas.calibration import Review, review_id
from schemas.trace import Candidate, Citation, Route, Signals, Trace
from schemas.verdict import CandidateGrade, Verdict
from services.common import rss
from services.common.settings import KafkaSettings, RedisSettings
from services.console.app import Console, create_app
from services.console.settings import ConsoleSettings
from services.console.store import ConsoleStore
from services.providers.collections import sample_queries
from services.providers.markets import market

CASES = ("all", "contested", "provider", "text", "deep")
TARGET_P95_MS = 300.0
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"n": len(a), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)}, "mean": float(a.mean()),
            "max": float(a.max())}


def synthetic(start: int, n: int, providers: list[str], queries: list[Any], args: argparse.Namespace,
              rng: random.Random) -> dict[str, list[Any]]:
    """Traces ``start`` .. ``start + n - 1``, a second apart, with their verdicts and reviews, per topic."""
    out: dict[str, list[Any]] = {"traces": [], "verdicts": [], "reviews": []}
    for i in range(start, start + n):
        q = queries[i % len(queries)]
        pool = [f"collection://{q.query_id.split('/')[0]}/{rng.randrange(2000)}" for _ in range(20)]
        cands = tuple(Candidate(
            provider=p, answer=f"answer of {p}", latency_ms=rng.uniform(20, 400), cost_usd=rng.uniform(0, 0.005),
            citations=tuple(Citation(url=u, title=f"doc {u}", rank=r + 1, snippet=q.text[:48] * 10,
                                     score=1.0 / (r + 1)) for r, u in enumerate(rng.sample(pool, 10))))
            for p in providers)
        signals = Signals(pairwise_overlap={f"{providers[0]}|{providers[1]}": 0.3}, mean_overlap=0.3,
                          min_overlap=0.1, contested=rng.random() < 0.25, contested_threshold=0.2,
                          providers_ok=len(providers), providers_failed=0)
        routed = rng.random() < args.routed
        t = Trace(trace_id=f"bench-{i:06d}", received_at=T0 + timedelta(seconds=i), query=q.text,
                  query_id=q.query_id, mode="routed" if routed else "fanout", candidates=cands, signals=signals,
                  router_version="router@1" if routed else None,
                  route=Route(router="router@1", called=(providers[0],)) if routed else None)
        out["traces"].append(t)
        if rng.random() < args.judged:
            grades = {p: rng.randrange(4) for p in providers}
            tiers = [tuple(sorted(p for p, g in grades.items() if g == level)) for level in (3, 2, 1, 0)]
            v = Verdict(verdict_id=content_id("verdict", t.trace_id), trace_id=t.trace_id,
                        judged_at=t.received_at + timedelta(seconds=5), judge_kind="bench", judge_model="bench",
                        rubric_version="r", rubric_hash="bench", status="ok", sampled_because="contested",
                        grades=tuple(CandidateGrade(provider=p, grade=g) for p, g in grades.items()),
                        ordering=tuple(x for x in tiers if x))
            out["verdicts"].append(v)
            if i % 20 == 0:
                out["reviews"].append(Review(
                    review_id=review_id(v.verdict_id, "bench"), verdict_id=v.verdict_id, reviewer="bench",
                    mark="agree", created_at=v.judged_at, trace_id=t.trace_id, judge_key="bench", source="console"))
    return out


def ingest(store: ConsoleStore, n: int, providers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``n`` traces made and stored ``--batch`` at a time through the follower's path (each topic's batch with
    its offsets in one transaction), so that the process holds one batch of records at most."""
    rng, queries, offsets = random.Random(0), sample_queries(seed=0), {"traces": 0, "verdicts": 0, "reviews": 0}
    made = stored = 0.0
    for start in range(0, n, args.batch):
        t0 = time.perf_counter()
        batch = synthetic(start, min(args.batch, n - start), providers, queries, args, rng)
        t1 = time.perf_counter()
        for name, messages in batch.items():
            store.ingest(name, [SimpleNamespace(message=m, partition=0, offset=offsets[name] + k)
                                for k, m in enumerate(messages)])
            offsets[name] += len(messages)
        made, stored = made + t1 - t0, stored + time.perf_counter() - t1
    return {"make_s": made, "store_s": stored, "counts": store.counts(), "rss_mb": rss.rss_mb(),
            "disk_mb": sum(p.stat().st_size for p in store.path.parent.iterdir()) / 2**20}


async def measure(app: Any, paths: dict[str, str], requests: int, warmup: int) -> dict[str, Any]:
    """Each case's latency, the cases interleaved request by request (a drift hits them alike)."""
    lat: dict[str, list[float]] = {c: [] for c in paths}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as client:
        for i in range(warmup + requests):
            for case, path in paths.items():
                t0 = time.perf_counter()
                r = await client.get(path, headers={"accept": "text/html"})
                ms = (time.perf_counter() - t0) * 1e3
                assert r.status_code == 200 and r.text.count('class="trace-row') >= 1, (path, r.status_code)
                if i >= warmup:
                    lat[case].append(ms)
    return {c: {"path": paths[c], **pct(v)} for c, v in lat.items()}


def one_size(n: int, root: Path, providers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    settings = ConsoleSettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                               redis=RedisSettings(url="memory://"), store_path=root / f"n{n}" / "console.sqlite3",
                               runs_dir=root / "runs")
    console = Console(settings)
    out: dict[str, Any] = {"traces": n, "rss_before_mb": rss.rss_mb()}
    out["ingest"] = ingest(console.store, n, providers, args)
    word = max((w for w in console.store.trace(f"bench-{n // 2:06d}").query.split() if w.isalpha()), key=len)
    last = -(-n // settings.page_size)
    paths = {"all": "/traces", "contested": "/traces?contested=true", "provider": f"/traces?provider={providers[-1]}",
             "text": f"/traces?q={word.lower()}", "deep": f"/traces?page={last}"}
    out["pages"] = asyncio.run(measure(create_app(settings, console), paths, args.requests, args.warmup))
    out["rss_after_requests_mb"] = rss.rss_mb()
    console.store.close()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    providers = [p.name for p in market(args.market)]
    root = Path(tempfile.mkdtemp(prefix="bench-console-", dir=args.tmp))
    out: dict[str, Any] = {"requests": args.requests, "warmup": args.warmup, "market": args.market,
                           "providers": providers, "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
                           "rss_start_mb": rss.rss_mb(), "sizes": {}}
    for n in (args.baseline, args.traces):
        print(f"{n} traces: ingest, then {args.warmup} + {args.requests} requests per case", file=sys.stderr)
        out["sizes"][str(n)] = one_size(n, root, providers, args)
    small, large = (out["sizes"][str(n)]["pages"] for n in (args.baseline, args.traces))
    out["ratio_p95"] = {c: large[c]["p95"] / small[c]["p95"] for c in CASES}
    out["target_p95_ms"] = TARGET_P95_MS
    out["target_met"] = all(large[c]["p95"] <= TARGET_P95_MS for c in CASES)
    out["rss_peak_mb"] = rss.hwm_mb()
    out["loadavg_after"] = os.getloadavg()
    return out


def report(out: dict[str, Any]) -> None:
    sizes = list(out["sizes"])
    print(f"\nconsole trace list, page of 50, {out['requests']} requests per case, {out['cpus']} CPUs, "
          f"load {out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}")
    print(f"{'case':<11}" + "".join(f"{f'{n} p50':>11}{'p95':>8}{'p99':>8}" for n in sizes) + f"{'p95 ratio':>11}")
    for c in CASES:
        row = "".join(f"{out['sizes'][n]['pages'][c]['p50']:>11.1f}{out['sizes'][n]['pages'][c]['p95']:>8.1f}"
                      f"{out['sizes'][n]['pages'][c]['p99']:>8.1f}" for n in sizes)
        print(f"{c:<11}{row}{out['ratio_p95'][c]:>10.2f}x")
    for n in sizes:
        s = out["sizes"][n]
        print(f"{n:>6} traces: made in {s['ingest']['make_s']:.1f} s, stored in {s['ingest']['store_s']:.1f} s ({s['ingest']['counts']}), store "
              f"{s['ingest']['disk_mb']:.0f} MB on disk; RSS {s['rss_before_mb']:.0f} -> {s['ingest']['rss_mb']:.0f} "
              f"MB after ingest, {s['rss_after_requests_mb']:.0f} MB after the requests")
    met = "met" if out["target_met"] else "NOT met"
    print(f"target (p95 <= {out['target_p95_ms']:.0f} ms at {sizes[-1]} traces, every case): {met}; "
          f"peak RSS {out['rss_peak_mb']:.0f} MB")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=int, default=10_000, help="traces stored for the measured size")
    p.add_argument("--baseline", type=int, default=1_000, help="traces stored for the baseline size")
    p.add_argument("--requests", type=int, default=200, help="measured requests per case and size")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--judged", type=float, default=0.6, help="share of traces with an ok verdict")
    p.add_argument("--routed", type=float, default=0.1, help="share of routed traces")
    p.add_argument("--batch", type=int, default=500, help="records per ingest transaction")
    p.add_argument("--market", default="federated")
    p.add_argument("--tmp", type=Path, default=None, help="where the stores go (default: the system's temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "console_pages.json")
    args = p.parse_args(argv)
    out = run(args)
    report(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
