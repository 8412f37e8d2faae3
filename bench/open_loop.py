"""The open-loop load generator of ``bench/routed_load.py`` and what it measures: request i is sent at
t0 + i/rate whatever came back before it (so a slow gateway queues, as real traffic does), each answer
recorded in a :class:`Window`; process memory from psutil or /proc; Prometheus counters read before and
after a window and subtracted."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is installed in the dev environment
    psutil = None

WORDS = ("protein folding", "heat transfer in boundary layers", "library cataloguing", "cell membranes",
         "supersonic flow", "information retrieval evaluation", "vitamin deficiency", "citation indexing")


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (psutil, else /proc/PID/status VmRSS)."""
    if psutil is not None:
        return psutil.Process(pid).memory_info().rss / 2**20
    return _proc_status_kb(pid, "VmRSS") / 1024


def hwm_mb(pid: int) -> float | None:
    """Peak resident memory of ``pid`` in MiB (Linux VmHWM), if known."""
    try:
        return _proc_status_kb(pid, "VmHWM") / 1024
    except (OSError, KeyError):
        return None


def _proc_status_kb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    raise KeyError(field)


def counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted labels): value} for counters, typed or not (several gateway
    workers' merged metrics carry no type lines: a ``_total`` sample of an untyped family counts too)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("counter", "unknown"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_delta(before: dict, after: dict, name: str, by: str | None = None) -> dict[str, float] | float:
    """Sum of counter ``name`` over the window, per label ``by`` (or in total)."""
    per: Counter[str] = Counter()
    for key, v in after.items():
        if key[0] == name:
            label = dict(key[1]).get(by, "") if by else ""
            per[label] += v - before.get(key, 0.0)
    return {k: int(round(v)) for k, v in per.items()} if by else int(round(sum(per.values())))


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    a = np.asarray(values)
    return {"n": len(values), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean())}


class Window:
    """What one measured window saw, request by request."""

    def __init__(self) -> None:
        self.sent = 0
        self.rows: list[dict[str, Any]] = []
        self.max_lag_ms = 0.0
        self.send_s = self.window_s = 0.0

    def latencies(self, mode: str | None = None) -> list[float]:
        return [r["ms"] for r in self.rows if r["ok"] and (mode is None or r["mode"] == mode)]


def request_body(prefix: str, i: int) -> dict[str, str]:
    return {"query": f"load test query {i} about {WORDS[i % len(WORDS)]}", "query_id": f"{prefix}-q{i}",
            "request_id": f"{prefix}-{i}"}


async def one(http: aiohttp.ClientSession, url: str, body: dict, scheduled: float, win: Window) -> None:
    loop = asyncio.get_running_loop()
    row: dict[str, Any] = {"ok": False, "mode": None, "error": None}
    try:
        async with http.post(url, json=body) as r:
            data = await r.json(content_type=None) if r.status == 200 else None
            if r.status != 200:
                row["error"] = f"http_{r.status}"
    except TimeoutError:
        row["error"] = "client_timeout"
    except aiohttp.ClientError as exc:
        row["error"] = type(exc).__name__
    else:
        if data is not None:
            route = data.get("route") or {}
            row.update(ok=True, mode=data["mode"], calls=[c["provider"] for c in data["candidates"]],
                       published=data["trace_status"] == "published", fallback=route.get("fallback"),
                       router_ms=route.get("router_ms"))
    row["ms"] = (loop.time() - scheduled) * 1000.0
    win.rows.append(row)


async def open_loop(http: aiohttp.ClientSession, url: str, prefix: str, rate: float, duration_s: float,
                    drain_s: float, win: Window, progress=None) -> None:
    """Send request i at t0 + i/rate for ``duration_s``, whatever came back; wait for the stragglers."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()
    t0 = loop.time()
    n = int(round(rate * duration_s))
    for i in range(n):
        at = t0 + i / rate
        if (delay := at - loop.time()) > 0:
            await asyncio.sleep(delay)
        win.max_lag_ms = max(win.max_lag_ms, (loop.time() - at) * 1000.0)
        task = asyncio.create_task(one(http, url, request_body(prefix, i), at, win))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        win.sent += 1
        if progress is not None:
            progress(loop.time() - t0, len(tasks))
    win.send_s = loop.time() - t0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
        for task in pending:
            task.cancel()
        for _ in pending:
            win.rows.append({"ok": False, "mode": None, "error": "unfinished", "ms": drain_s * 1000.0})
    win.window_s = loop.time() - t0
