"""A Kafka outage under steady gateway traffic: latency during the outage, and what reached the topic.

Open-loop traffic (``--rate`` requests/s, each with a unique ``request_id``) against an in-process
gateway (served over HTTP by uvicorn; two static in-process providers, so the fan-out itself costs
nothing); ``--before`` seconds in, the real Kafka broker is stopped (SIGSTOP, or ``docker pause``) for
``--pause`` seconds, then resumed, and traffic goes on for ``--after`` seconds. Then the spool is left to
drain and every record on the run's traces topic (a fresh namespace) is read back and counted by trace
id: ``lost`` = answered trace ids never on the topic, ``duplicates`` = records beyond one per id.

Two gateways, the same traffic, one after the other:

* ``before`` (the behaviour up to issue 13): a publish waits up to ``publish_timeout_s`` (5 s) for acks;
  one that fails is reported ``trace_published=false`` and dropped (the send is cancelled);
* ``after``: the outbox, ``publish_wait_s`` (0.5 s) then the durable spool and its drainer.

Latency is client-side from each request's scheduled send time, reported per phase (``outage`` = sent
while the broker was stopped). The broker: ``$KAFKA_BOOTSTRAP_SERVERS`` when set (its process must be
visible on this machine to be paused), else a broker of the project's local stack started for the run
in a temporary directory (jars from ``.stack/kafka-libs``).

    python bench/gateway_outage.py --rate 5 --before 10 --pause 15 --after 10
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
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx
import numpy as np

from schemas import Citation, Trace, topic
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.outbox import TraceOutbox, TraceStatus
from services.gateway.settings import GatewaySettings
from services.providers.base import Provider, ProviderAnswer, build_answer
from services.providers.config import BM25Config
from services.tools.serving import free_port, served

DEFAULTS = {"rate": 5.0, "before": 10.0, "pause": 15.0, "after": 10.0}
LEGACY_UNPUBLISHED = "unpublished (before the outbox)"
PHASES = ("before", "outage", "after")


class InstantProvider(Provider):
    """Answers at once with two fixed citations (the bench measures the trace path, not search)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, cost_usd=0.0, timeout_s=2.0, k=10)

    async def search(self, query: str) -> ProviderAnswer:
        cits = tuple(Citation(url=f"https://{self.name}.example/{i}", title=f"{query} {i}", rank=i + 1,
                              snippet=f"about {query}") for i in range(2))
        return ProviderAnswer(citations=cits, answer=build_answer(cits), cost_usd=0.0)


class LegacyOutbox(TraceOutbox):
    """The gateway before issue 13: wait ``publish_timeout_s`` for acks, then report the trace unpublished
    (here: ``trace_error`` starts with :data:`LEGACY_UNPUBLISHED`) and keep nothing."""

    async def publish(self, trace: Trace) -> tuple[TraceStatus, str | None]:
        try:
            await self.bus.publish(topic("traces"), trace)
        except BusError as exc:
            self.metrics.traces_unpublished.inc()
            return "spooled", f"{LEGACY_UNPUBLISHED}: {exc}"
        self.metrics.traces_published.inc()
        return "published", None


def pct(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    a = np.asarray(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 1),
            "p99": round(float(np.percentile(a, 99)), 1), "max": round(float(a.max()), 1)}


async def _records(kafka: KafkaSettings) -> list[Trace]:
    return [t async for t in read_topic(kafka, topic("traces"), model=Trace, strict=True)]


async def outage(kafka: KafkaSettings, pause: Callable[[], None], resume: Callable[[], None], *,
                 spool_dir: Path, rate: float, before_s: float, pause_s: float, after_s: float,
                 publish_wait_s: float = 0.5, legacy: bool = False, drain_timeout_s: float = 120.0,
                 settle_s: float = 60.0) -> dict[str, Any]:
    """One run (see the module docstring); ``kafka`` must name a fresh topic namespace."""
    settings = GatewaySettings(kafka=kafka, port=free_port(), publish_wait_s=publish_wait_s, spool_dir=spool_dir,
                               providers=[BM25Config(name="unused")], log_level="WARNING")
    gw = build_gateway(settings, bus=Bus(kafka, client_id="bench-outage"),
                       providers=[InstantProvider("alpha"), InstantProvider("beta")])
    if legacy:
        gw.outbox = LegacyOutbox(gw.bus, gw.metrics, spool_dir=spool_dir, publish_wait_s=publish_wait_s,
                                 max_bytes=settings.spool_max_bytes, max_records=settings.spool_max_records)
    run = uuid.uuid4().hex[:8]
    n = round(rate * (before_s + pause_s + after_s))
    rows: list[dict[str, Any]] = []
    window: dict[str, float] = {}
    app = create_app(settings, gateway=gw)
    async with served(app, settings.port, what="gateway", start_timeout_s=120) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        await client.post("/v1/search", json={"query": "warm up"})  # connections, first trace

        async def one(i: int, scheduled: float) -> None:
            row: dict[str, Any] = {"i": i, "sent": scheduled - t0}
            try:
                r = await client.post("/v1/search", json={"query": f"outage query {i}",
                                                          "request_id": f"outage-{run}-{i}"})
                row["status"] = r.status_code
                if r.status_code == 200:
                    body = r.json()
                    row["trace_id"] = body["trace_id"]
                    err = body.get("trace_error") or ""
                    row["trace"] = "unpublished" if err.startswith(LEGACY_UNPUBLISHED) else body["trace_status"]
                else:
                    row["error"] = r.json().get("error")
            except httpx.HTTPError as exc:
                row["status"], row["error"] = None, type(exc).__name__
            row["ms"] = (time.perf_counter() - scheduled) * 1000.0
            rows.append(row)

        async def broker_outage() -> None:
            await asyncio.sleep(max(0.0, t0 + before_s - time.perf_counter()))
            await asyncio.to_thread(pause)
            window["paused"] = time.perf_counter() - t0
            try:
                await asyncio.sleep(max(0.0, t0 + before_s + pause_s - time.perf_counter()))
            finally:
                await asyncio.to_thread(resume)
                window["resumed"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        fault = asyncio.create_task(broker_outage())
        tasks = []
        try:
            for i in range(n):
                scheduled = t0 + i / rate
                await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i, scheduled)))
            await asyncio.gather(*tasks)
        finally:
            await fault  # always resumes the broker
        answered_s = time.perf_counter() - t0
        deadline = time.monotonic() + drain_timeout_s
        while gw.outbox.spool.depth and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        drained_s = time.perf_counter() - t0
        depth_left = gw.outbox.spool.depth
        metrics = (await client.get("/metrics")).text
    answered = {r["trace_id"] for r in rows if r.get("trace_id")}
    deadline = time.monotonic() + settle_s
    while True:  # the topic, until every answered trace is there (or, before the outbox, it stops growing)
        records = [t for t in await _records(kafka) if t.trace_id in answered or t.query.startswith("outage")]
        if answered <= {t.trace_id for t in records} or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    by_id = Counter(t.trace_id for t in records)

    def phase(r: dict[str, Any]) -> str:
        return ("before" if r["sent"] < window.get("paused", before_s) else
                "outage" if r["sent"] < window.get("resumed", before_s + pause_s) else "after")

    def metric(name: str) -> float:
        return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " ")), 0.0)

    return {
        "variant": "before" if legacy else "after", "publish_wait_s": None if legacy else publish_wait_s,
        "publish_timeout_s": kafka.publish_timeout_s, "rate": rate, "requests": n,
        "window_s": {"paused_at": round(window.get("paused", 0), 2), "resumed_at": round(window.get("resumed", 0), 2),
                     "answered_at": round(answered_s, 2), "spool_drained_at": round(drained_s, 2)},
        "answered_200": sum(r.get("status") == 200 for r in rows),
        "errors": dict(Counter(str(r.get("error") or r.get("status")) for r in rows if r.get("status") != 200)),
        "trace_status": dict(Counter(r.get("trace") for r in rows if r.get("trace"))),
        "trace_status_by_phase": {p: dict(Counter(r.get("trace") for r in rows if phase(r) == p)) for p in PHASES},
        "latency_ms": {p: pct([r["ms"] for r in rows if phase(r) == p]) for p in PHASES},
        "on_topic_records": sum(by_id[i] for i in answered),
        "on_topic_distinct": len(answered & by_id.keys()),
        "lost": len(answered - by_id.keys()),
        "duplicates": sum(by_id[i] - 1 for i in answered if by_id[i] > 1),
        "spool_left": depth_left,
        "spool_late_acks": metric("fanroute_traces_spool_late_acks_total"),
        "spool_republished": metric("fanroute_traces_spool_republished_total"),
        "spool_found_on_topic": metric("fanroute_traces_spool_found_on_topic_total"),
        "answered_ids": sorted(answered),
        "topic_ids": sorted(i for i in answered for _ in range(by_id[i])),  # one per record on the topic
    }


def _broker(state_dir: Path) -> tuple[str, Callable[[], None], Callable[[], None], str]:
    from tests.support.broker_pause import broker_pauser

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if bootstrap:
        pause, resume, how = broker_pauser(None, bootstrap)
        return bootstrap, pause, resume, how
    import devstack

    info = devstack.up(state_dir, kafka_port=0, libs_dir=ROOT / ".stack" / "kafka-libs", components=("kafka",))

    class _Local:
        _state_dir = state_dir

    pause, resume, how = broker_pauser(_Local(), info.bootstrap_servers)
    return info.bootstrap_servers, pause, resume, how


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fanroute-outage-") as tmp:
        stack_dir = Path(tmp) / "stack"
        bootstrap, pause, resume, how = _broker(stack_dir)
        try:
            out: dict[str, Any] = {"bench": "gateway_outage", "broker": how, "args": vars(args) | {"out": None}}
            for legacy in (True, False):
                kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"outage{uuid.uuid4().hex[:8]}.")
                res = await outage(kafka, pause, resume, spool_dir=Path(tmp) / f"spool-{legacy}", rate=args.rate,
                                   before_s=args.before, pause_s=args.pause, after_s=args.after,
                                   publish_wait_s=args.publish_wait, legacy=legacy)
                res.pop("answered_ids"), res.pop("topic_ids")
                out[res["variant"]] = res
                print(json.dumps(res, indent=1), file=sys.stderr)
        finally:
            if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
                import devstack

                devstack.down(stack_dir)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"], help="requests per second")
    p.add_argument("--before", type=float, default=DEFAULTS["before"], help="seconds of traffic before the outage")
    p.add_argument("--pause", type=float, default=DEFAULTS["pause"], help="seconds the broker is stopped")
    p.add_argument("--after", type=float, default=DEFAULTS["after"], help="seconds of traffic after it")
    p.add_argument("--publish-wait", type=float, default=0.5, help="publish_wait_s of the outbox gateway")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_outage.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for v in ("before", "after"):
        r = result[v]
        print(f"{v:>6}: outage p99 {r['latency_ms']['outage']['p99']} ms, p50 {r['latency_ms']['outage']['p50']} ms; "
              f"{r['answered_200']}/{r['requests']} answered 200, statuses {r['trace_status']}; on the topic "
              f"{r['on_topic_distinct']} distinct ({r['on_topic_records']} records), lost {r['lost']}, "
              f"duplicates {r['duplicates']}")
    return result


if __name__ == "__main__":
    main()
