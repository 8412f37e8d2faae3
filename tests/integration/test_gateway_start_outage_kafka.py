"""The gateway started while Kafka is unreachable: it serves from the first request (every trace
spooled), says ``degraded`` on ``/healthz``, and drains the spool onto a real broker that comes up
later on the port it was given, each trace exactly once; a clean stop in an outage is bounded and
leaves the spool intact; a spool that cannot take more makes ``/healthz`` a 503.

Before the gateway had a link that retries (services/gateway/link.py), its lifespan awaited
``bus.start`` and the app never served: the first test fails at its first request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from bench.gateway_outage import InstantProvider
from schemas import Trace, topic
from services.common.bus import Bus
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.common.spool import Spool
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from tests.support import fault_matrix
from tests.support.poll import eventually
from tests.support.serving import free_port, served

SHARED_LIBS = Path(__file__).resolve().parents[2] / ".stack" / "kafka-libs"  # the session stack's jar cache
pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]


def gateway_settings(kafka: KafkaSettings, spool: Path, **kw) -> GatewaySettings:
    return GatewaySettings(kafka=kafka, port=free_port(), spool_dir=spool, publish_wait_s=0.5,
                           kafka_connect_timeout_s=2.0, providers=[BM25Config(name="unused")], log_level="WARNING",
                           **kw)


def unreachable(ns: str) -> KafkaSettings:
    """A broker address nothing listens on (yet), with a short back-off so a test does not wait long."""
    return KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}", topic_namespace=ns, request_timeout_ms=2000,
                         transient_backoff_initial_s=0.2, transient_backoff_max_s=1.0)


async def test_starts_in_an_outage_serves_and_drains_when_the_broker_appears(tmp_path, request):
    from devstack import stack

    ns = f"gwstart{uuid.uuid4().hex[:8]}."
    kafka = unreachable(ns)
    port = int(kafka.bootstrap_servers.rsplit(":", 1)[1])
    settings = gateway_settings(kafka, tmp_path / "spool")
    gw = build_gateway(settings, bus=Bus(kafka, client_id="gw-start-outage"),
                       providers=[InstantProvider("alpha"), InstantProvider("beta")])
    state = tmp_path / "late-broker"
    answered: dict[str, str] = {}
    async with served(create_app(settings, gateway=gw), settings.port, what="gateway", start_timeout_s=60) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.get("/healthz")
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert r.json()["link"]["state"] == "connecting" and "Kafka unreachable" in r.json()["reasons"][0]
        for i in range(12):  # served, every trace spooled before its answer
            r = await client.post("/v1/search", json={"query": f"outage start {i}", "request_id": f"{ns}{i}"})
            assert r.status_code == 200 and r.json()["trace_status"] == "spooled", r.text
            answered[r.json()["trace_id"]] = r.json()["trace_status"]
        assert (await client.get("/healthz")).json()["spool"]["depth"] == 12
        try:
            await asyncio.to_thread(stack.up, state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)

            async def drained() -> bool:
                h = (await client.get("/healthz")).json()
                return h["status"] == "ok" and h["spool"]["depth"] == 0

            await eventually(drained, timeout_s=180, what="the spool drained onto the late broker")
            r = await client.post("/v1/search", json={"query": "after", "request_id": f"{ns}after"})
            assert r.json()["trace_status"] == "published", r.text
            answered[r.json()["trace_id"]] = "published"
            traces = [t async for t in read_topic(KafkaSettings(bootstrap_servers=kafka.bootstrap_servers,
                                                                topic_namespace=ns), topic("traces"), model=Trace)]
        finally:
            await asyncio.to_thread(stack.down, state, wipe=True)
    republished = gw.metrics.registry.get_sample_value("fanroute_traces_spool_republished_total")
    row = fault_matrix.exactly_once(
        "gateway started with Kafka unreachable; the broker comes up later", "gateway (trace outbox)",
        fault_matrix.test_id(request), records_in=len(answered), expected=answered,
        results=[t.trace_id for t in traces], spooled=12, republished=republished)
    assert row.lost == 0 and row.duplicates == 0 and republished == 12  # the re-publish path really ran


async def test_a_stop_in_an_outage_is_bounded_and_keeps_the_spool(tmp_path):
    ns = f"gwstop{uuid.uuid4().hex[:8]}."
    kafka = unreachable(ns)
    settings = gateway_settings(kafka, tmp_path / "spool", shutdown_timeout_s=5.0)
    gw = build_gateway(settings, bus=Bus(kafka, client_id="gw-stop-outage"), providers=[InstantProvider("alpha")])
    app = create_app(settings, gateway=gw)
    async with served(app, settings.port, what="gateway", start_timeout_s=60) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in range(3):
            r = await client.post("/v1/search", json={"query": f"stop {i}", "request_id": f"{ns}{i}"})
            assert r.json()["trace_status"] == "spooled"
        t0 = time.monotonic()
    stopped_in = time.monotonic() - t0  # uvicorn's shutdown ran the lifespan's stop
    assert stopped_in < settings.shutdown_timeout_s + 2.0, stopped_in
    spool = Spool(tmp_path / "spool", "traces")
    left = spool.open()
    spool.close()
    assert len(left) == 3  # intact: the next start re-publishes them


async def test_healthz_is_503_when_the_spool_cannot_take_more(tmp_path):
    ns = f"gwfull{uuid.uuid4().hex[:8]}."
    kafka = unreachable(ns)
    settings = gateway_settings(kafka, tmp_path / "spool", spool_max_records=2)
    gw = build_gateway(settings, bus=Bus(kafka, client_id="gw-full"), providers=[InstantProvider("alpha")])
    async with served(create_app(settings, gateway=gw), settings.port, what="gateway", start_timeout_s=60) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in range(2):
            r = await client.post("/v1/search", json={"query": f"full {i}", "request_id": f"{ns}{i}"})
            assert r.json()["trace_status"] == "spooled"
        r = await client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
        assert any("cannot take more" in why for why in r.json()["reasons"])
        r = await client.post("/v1/search", json={"query": "one too many", "request_id": f"{ns}x"})
        assert r.status_code == 503 and r.json()["error"] == "spool_full", r.text
