"""Kafka killed with SIGKILL under steady gateway traffic and started again 15 s later (same port, same
data): every request answered, the outage's traces spooled and **re-published** from the spool (the
re-publish path running for real, not only late acks of first sends), each trace on the topic exactly once.

The broker is the test's own (devstack, its own state directory), so killing it leaves the session's alone.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from bench.gateway_outage import outage
from services.common.settings import KafkaSettings
from tests.support import fault_matrix
from tests.support.serving import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]
SHARED_LIBS = Path(__file__).resolve().parents[2] / ".stack" / "kafka-libs"  # the session stack's jar cache
DOWN_S = 15.0


async def test_a_broker_killed_and_restarted_loses_no_trace(tmp_path, request):
    import asyncio

    from devstack import stack

    state = tmp_path / "broker"
    port = free_port()
    info = await asyncio.to_thread(stack.up, state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)
    kafka = KafkaSettings(bootstrap_servers=info.bootstrap_servers, topic_namespace=f"kill{uuid.uuid4().hex[:8]}.",
                          transient_backoff_initial_s=0.2, transient_backoff_max_s=1.0)
    killed: list[int] = []

    def kill() -> None:
        pid = int((state / "kafka.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    def restart() -> None:
        stack.up(state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)

    try:
        res = await outage(kafka, kill, restart, spool_dir=tmp_path / "spool", rate=4.0, before_s=3.0,
                           pause_s=DOWN_S, after_s=3.0, drain_timeout_s=180.0, settle_s=120.0)
    finally:
        await asyncio.to_thread(stack.down, state, wipe=True)
    row = fault_matrix.report(fault_matrix.count(
        "Kafka kill -9 under 4 req/s, restarted after 15 s", "gateway (trace outbox)", fault_matrix.test_id(request),
        records_in=res["requests"], expected=res["answered_ids"], results=res["topic_ids"],
        spooled=res["trace_status"].get("spooled", 0), republished=res["spool_republished"],
        late_acks=res["spool_late_acks"], broker=f"SIGKILL pid {killed}"))
    summary = {k: v for k, v in res.items() if k not in ("answered_ids", "topic_ids")}
    assert killed and res["answered_200"] == res["requests"], summary
    assert res["trace_status_by_phase"]["outage"].get("spooled", 0) > 0, summary
    # every spooled trace is accounted for once: its first send (the idempotent producer retries it through
    # the outage and it lands after the restart: a late ack) or the spool's re-publish
    assert res["spool_late_acks"] + res["spool_republished"] == res["trace_status"]["spooled"], summary
    assert row.lost == 0 and row.duplicates == 0 and res["spool_left"] == 0, summary


async def test_a_gateway_restarted_while_the_broker_is_dead_republishes_its_spool(tmp_path, request):
    """The same kill, and the gateway stopped and started again while the broker is dead: the first run's
    first sends die with it, so only the spool carries their traces; the second run starts in the outage,
    spools its own, and re-publishes both once the broker is back."""
    import asyncio

    import httpx

    from bench.gateway_outage import InstantProvider
    from devstack import stack
    from schemas import Trace, topic
    from services.common.bus import Bus
    from services.common.replay_topic import read_topic
    from services.gateway.app import build_gateway, create_app
    from services.gateway.settings import GatewaySettings
    from services.providers.config import BM25Config
    from tests.support.poll import eventually
    from tests.support.serving import served

    state = tmp_path / "broker"
    port = free_port()
    info = await asyncio.to_thread(stack.up, state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)
    kafka = KafkaSettings(bootstrap_servers=info.bootstrap_servers, topic_namespace=f"killgw{uuid.uuid4().hex[:8]}.",
                          transient_backoff_initial_s=0.2, transient_backoff_max_s=1.0, request_timeout_ms=3000)
    answered: dict[str, str] = {}

    def gateway():
        settings = GatewaySettings(kafka=kafka, port=free_port(), spool_dir=tmp_path / "spool", publish_wait_s=0.5,
                                   kafka_connect_timeout_s=3.0, shutdown_timeout_s=5.0,
                                   providers=[BM25Config(name="unused")], log_level="WARNING")
        gw = build_gateway(settings, bus=Bus(kafka, client_id="gw-kill"), providers=[InstantProvider("alpha")])
        return settings, gw

    async def send(url: str, tag: str, n: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for i in range(n):
                r = await client.post("/v1/search", json={"query": f"kill {tag} {i}", "request_id": f"{tag}-{i}"})
                assert r.status_code == 200, r.text
                answered[r.json()["trace_id"]] = r.json()["trace_status"]

    try:
        settings, first = gateway()
        async with served(create_app(settings, gateway=first), settings.port, what="gateway") as url:
            await send(url, "before", 5)
            os.kill(int((state / "kafka.pid").read_text().split()[0]), signal.SIGKILL)
            t_kill = asyncio.get_running_loop().time()
            await send(url, "first-run", 8)
        settings, second = gateway()  # the same spool directory
        async with served(create_app(settings, gateway=second), settings.port, what="gateway") as url:
            await send(url, "second-run", 4)
            await asyncio.sleep(max(0.0, t_kill + DOWN_S - asyncio.get_running_loop().time()))
            await asyncio.to_thread(stack.up, state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)
            await eventually(lambda: second.outbox.spool.depth == 0 and second.link.connected or None,
                             timeout_s=180, what="the second run draining the spool")
            republished = second.metrics.registry.get_sample_value("fanroute_traces_spool_republished_total")
        traces = [t async for t in read_topic(kafka, topic("traces"), model=Trace)]
    finally:
        await asyncio.to_thread(stack.down, state, wipe=True)
    spooled = sum(v == "spooled" for v in answered.values())
    row = fault_matrix.exactly_once(
        "Kafka kill -9, and the gateway restarted during the outage; broker back after 15 s",
        "gateway (trace outbox)", fault_matrix.test_id(request), records_in=len(answered), expected=answered,
        results=[t.trace_id for t in traces if t.trace_id in answered], spooled=spooled, republished=republished)
    assert spooled == 12 and republished == 12 and row.lost == 0  # the re-publish path ran for real
