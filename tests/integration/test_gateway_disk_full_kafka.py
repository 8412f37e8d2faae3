"""The spool's disk fills up during an outage: the gateway answers 503 ``spool_full`` (with the disk's
reason) once a trace no longer fits, ``/healthz`` says the spool cannot take more, and every trace it
answered ``spooled`` reaches a real broker that comes up later, exactly once; the gateway then publishes
and spools again.

The disk is a real 64 KiB tmpfs, so the error is the kernel's ``ENOSPC`` (or a short write), not a mock.
Before the spool told a full disk apart, this answered 503 ``spool_unavailable`` and ``/healthz`` kept
saying the spool could take more.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest

from bench.gateway_outage import InstantProvider
from schemas import Trace, topic
from services.common.bus import Bus
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from tests.integration.test_gateway_start_outage_kafka import SHARED_LIBS, gateway_settings, unreachable
from tests.support import fault_matrix
from tests.support.poll import eventually
from tests.support.serving import served
from tests.support.tmpfs import small_tmpfs

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]
DISK_BYTES = 64 << 10
MAX_REQUESTS = 2000  # far more traces than 64 KiB holds


async def test_a_full_spool_disk_is_503_spool_full_and_loses_no_spooled_trace(tmp_path, request):
    from devstack import stack

    ns = f"gwdisk{uuid.uuid4().hex[:8]}."
    kafka = unreachable(ns)
    port = int(kafka.bootstrap_servers.rsplit(":", 1)[1])
    state = tmp_path / "late-broker"
    with small_tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        settings = gateway_settings(kafka, disk / "spool")
        gw = build_gateway(settings, bus=Bus(kafka, client_id="gw-disk-full"), providers=[InstantProvider("alpha")])
        answered: dict[str, str] = {}
        async with served(create_app(settings, gateway=gw), settings.port, what="gateway",
                          start_timeout_s=60) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            refused = None
            for i in range(MAX_REQUESTS):
                r = await client.post("/v1/search", json={"query": f"disk full {i}", "request_id": f"{ns}{i}"})
                if r.status_code == 503:
                    refused = r
                    break
                assert r.status_code == 200 and r.json()["trace_status"] == "spooled", r.text
                answered[r.json()["trace_id"]] = "spooled"
            assert refused is not None, f"{MAX_REQUESTS} traces fitted in {DISK_BYTES} bytes"
            assert refused.json()["error"] == "spool_full" and "disk full" in refused.json()["reason"], refused.text
            assert len(answered) >= 5
            health = await client.get("/healthz")
            assert health.status_code == 503 and "disk full" in " ".join(health.json()["reasons"]), health.text
            assert health.json()["spool"]["depth"] == len(answered)
            try:
                await asyncio.to_thread(stack.up, state, port, 0, components=("kafka",), libs_dir=SHARED_LIBS)

                async def drained() -> bool:
                    h = await client.get("/healthz")
                    return h.status_code == 200 and h.json()["spool"]["depth"] == 0

                await eventually(drained, timeout_s=180, what="the full spool drained onto the late broker")
                r = await client.post("/v1/search", json={"query": "room again", "request_id": f"{ns}after"})
                assert r.status_code == 200 and r.json()["trace_status"] == "published", r.text
                answered[r.json()["trace_id"]] = "published"
                traces = [t async for t in read_topic(KafkaSettings(bootstrap_servers=kafka.bootstrap_servers,
                                                                    topic_namespace=ns), topic("traces"), model=Trace)]
            finally:
                await asyncio.to_thread(stack.down, state, wipe=True)
    registry = gw.metrics.registry
    refused_full = registry.get_sample_value("fanroute_traces_spool_refused_total", {"reason": "spool_full"})
    row = fault_matrix.exactly_once(
        "the spool's disk (a 64 KiB tmpfs) fills up while Kafka is unreachable; the broker comes up later",
        "gateway (trace outbox)", fault_matrix.test_id(request), records_in=len(answered) + 1, expected=answered,
        results=[t.trace_id for t in traces], spooled=len(answered) - 1, refused_spool_full=refused_full)
    assert row.lost == 0 and row.duplicates == 0 and refused_full == 1
