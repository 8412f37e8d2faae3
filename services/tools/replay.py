"""``fanroute replay``: send the collections' queries through a running gateway at a fixed rate.

Open-loop: request *i* is scheduled at ``i / rate`` seconds whatever earlier requests are doing
(bounded by ``concurrency`` in flight), so a slow gateway shows up as latency, not as a lower rate.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from services.common.errors import ConfigError
from services.providers.collections import ReplayQuery


@dataclass
class ReplaySummary:
    """What a replay saw; latencies are client-side round-trip times."""

    requests: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    traces_spooled: int = 0  # answered trace_status=spooled: on the way to Kafka from the spool
    contested: int = 0
    provider_errors: int = 0
    seconds: float = 0.0
    latency_ms: list[float] = field(default_factory=list, repr=False)

    def percentiles(self) -> dict[str, float]:
        lat = np.asarray(self.latency_ms or [0.0])
        return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}

    def as_dict(self) -> dict[str, object]:
        d = {k: v for k, v in asdict(self).items() if k != "latency_ms"}
        return {**d, **self.percentiles(), "throughput_rps": self.requests / self.seconds if self.seconds else 0}

    def render(self) -> str:
        p = self.percentiles()
        errs = sum(self.errors.values())
        return (f"requests={self.requests} ok={self.ok} errors={errs} {dict(self.errors) or ''}\n"
                f"latency p50={p['p50_ms']:.1f} ms p99={p['p99_ms']:.1f} ms over {self.seconds:.1f} s "
                f"({self.requests / self.seconds if self.seconds else 0:.1f} req/s)\n"
                f"traces spooled={self.traces_spooled} contested={self.contested} "
                f"provider errors={self.provider_errors}")


async def replay(url: str, queries: list[ReplayQuery], *, rate: float, concurrency: int,
                 timeout_s: float = 60.0, progress: bool = True) -> ReplaySummary:
    """Send ``queries`` to ``url``/v1/search at ``rate`` per second; return the summary."""
    if rate <= 0 or concurrency < 1:
        raise ConfigError(f"rate must be > 0 and concurrency >= 1 (got {rate}, {concurrency})")
    summary = ReplaySummary()
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(queries), desc="replay", unit="q", disable=not progress)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, q: ReplayQuery) -> None:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            async with sem:
                await _send(client, q, summary)
            bar.update(1)

        await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)))
        summary.seconds = time.perf_counter() - t0
    bar.close()
    return summary


async def _send(client: httpx.AsyncClient, q: ReplayQuery, summary: ReplaySummary) -> None:
    t = time.perf_counter()
    summary.requests += 1
    try:
        r = await client.post("/v1/search", json={"query": q.text, "query_id": q.query_id})
    except httpx.HTTPError as exc:
        key = type(exc).__name__
    else:
        summary.latency_ms.append((time.perf_counter() - t) * 1000.0)
        if r.status_code == 200:
            body = r.json()
            summary.ok += 1
            summary.traces_spooled += body.get("trace_status") == "spooled"
            summary.contested += bool(body["signals"]["contested"])
            summary.provider_errors += sum(c["error"] is not None for c in body["candidates"])
            return
        key = f"http_{r.status_code}"
    summary.errors[key] = summary.errors.get(key, 0) + 1


def write_summary(summary: ReplaySummary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary.as_dict(), indent=2, sort_keys=True) + "\n")
