"""``fanroute demo``: the main job as far as it exists — real Kafka, the gateway over the bundled
collections, a replay of their queries, the traces read back from the topic, and a report
of what each provider (and the oracle, and full fan-out) scores against human qrels.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from schemas.trace import Trace
from services.common.settings import KafkaSettings
from services.gateway.providers.collections import default_collections_dir
from services.tools.replay import replay, sample_queries
from services.tools.report import render, score_traces, write_report
from services.tools.traces import format_trace, read_traces

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo run."""

    queries: int = 80
    rate: float = 10.0
    concurrency: int = 8
    seed: int = 0
    out_dir: Path = REPO / "out" / "demo"
    keep_stack: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns a process exit code."""
    from services.common import stack

    started_stack = False
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS")
    if not bootstrap:
        print("[1/5] starting Apache Kafka (KRaft) and redis-server on loopback ...", flush=True)
        info = stack.up(REPO / ".stack")
        bootstrap, started_stack = info.bootstrap_servers, True
    print(f"      Kafka at {bootstrap}", flush=True)
    try:
        return await _demo(opts, KafkaSettings(bootstrap_servers=bootstrap))
    finally:
        if started_stack and not opts.keep_stack:
            print("stopping the stack (use --keep-stack to leave it running)", flush=True)
            stack.down(REPO / ".stack")


async def _demo(opts: DemoOptions, kafka: KafkaSettings) -> int:
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(kafka=kafka, port=_free_port())
    print(f"[2/5] starting the gateway with providers {[p.name for p in settings.providers]}"
          " (indexes are built once and cached; the first run builds them) ...", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port,
                                           log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve())
    t0 = time.perf_counter()
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("gateway exited during start-up")
        await asyncio.sleep(0.1)
    print(f"      gateway ready at http://127.0.0.1:{settings.port} in {time.perf_counter() - t0:.1f}s",
          flush=True)
    try:
        return await _traffic(opts, kafka, f"http://127.0.0.1:{settings.port}")
    finally:
        server.should_exit = True
        await serving


async def _traffic(opts: DemoOptions, kafka: KafkaSettings, url: str) -> int:
    queries = sample_queries(limit=opts.queries, seed=opts.seed)
    since = datetime.now(UTC)
    print(f"[3/5] replaying {len(queries)} judged development queries at {opts.rate:g}/s; "
          "traces as they land on the Kafka topic:", flush=True)
    traces: list[Trace] = []

    async def watch() -> None:
        async for t in read_traces(kafka, limit=len(queries), idle_s=60.0, since=since):
            traces.append(t)
            tqdm.write("  " + format_trace(t))

    watcher = asyncio.create_task(watch())
    summary = await replay(url, queries, rate=opts.rate, concurrency=opts.concurrency)
    try:
        await asyncio.wait_for(watcher, timeout=60)
    except TimeoutError:
        print(f"      only {len(traces)} of {len(queries)} traces arrived within 60 s")
    print("[4/5] replay summary\n" + summary.render(), flush=True)
    if traces:
        ov = np.percentile([t.signals.mean_overlap for t in traces], [10, 50, 90])
        n_contested = sum(t.signals.contested for t in traces)
        print(f"      mean citation overlap p10/p50/p90 = {ov[0]:.2f}/{ov[1]:.2f}/{ov[2]:.2f}; "
              f"contested (below {traces[0].signals.contested_threshold:g}): {n_contested}/{len(traces)}")
    rows = score_traces(traces, default_collections_dir())
    print(f"[5/5] {len(traces)} traces read back from Kafka\n" + render(rows, len(traces)), flush=True)
    jpath, ppath = write_report(rows, opts.out_dir)
    print(f"report: {jpath}\nplot:   {ppath}")
    return 0 if summary.ok == len(queries) and len(traces) == len(queries) else 1
