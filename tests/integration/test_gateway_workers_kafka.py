"""``FANROUTE_WORKERS=2`` on the real broker: two gateway processes share the port (both answer), every
answered trace is on the topic, ``/metrics`` on either counts both, what gone workers left spooled is
adopted and published, and SIGTERM stops them all cleanly (exit 0, spools closed and empty)."""

from __future__ import annotations

import json
import os
import signal
import uuid

import httpx
import pytest

from schemas import topic
from schemas.trace import Trace
from services.common.bus import Bus
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.common.spool import Spool
from tests.support.poll import eventually
from tests.support.processes import running, service_env
from tests.support.records import trace
from tests.support.serving import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REQUESTS = 30


def _leave_spooled(directory, trace_id: str, bus: Bus) -> None:
    """A trace a gateway that no longer runs spooled and never published."""
    wire, value, key, headers = bus.record_of(topic("traces"), trace(trace_id))
    s = Spool(directory, "traces")
    s.open()
    s.append(wire, value, key=key, headers=headers)
    s.close()


def _up(url: str) -> bool:
    try:
        return _fresh(url, "/healthz").status_code == 200
    except httpx.TransportError:
        return False


def _fresh(url: str, path: str, **kw) -> httpx.Response:
    """One request on its own connection (SO_REUSEPORT balances connections, not requests)."""
    with httpx.Client(timeout=30) as c:
        return c.request("POST" if "json" in kw else "GET", url + path, **kw)


async def test_two_workers_share_the_port_the_topic_and_the_metrics(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"gw{uuid.uuid4().hex[:8]}.")
    spool = tmp_path / "spool"
    bus = Bus(kafka, client_id="test")
    _leave_spooled(spool, "left-by-single", bus)  # a single-process run's spool: worker 0 adopts it
    _leave_spooled(spool / "worker-3", "left-by-worker-3", bus)  # a run with 4 workers: worker 1 adopts it
    pport, gport = free_port(), free_port()
    providers = [{"type": "searxng", "name": f"p{i}", "base_url": f"http://127.0.0.1:{pport}/p{i}", "timeout_s": 5,
                  "max_retries": 0} for i in range(2)]
    env = service_env(kafka, "memory://", FANROUTE_WORKERS="2", FANROUTE_PORT=str(gport),
                      FANROUTE_PROVIDERS=json.dumps(providers), FANROUTE_SPOOL_DIR=str(spool),
                      FANROUTE_REQUIRE_KAFKA_AT_START="true")
    url = f"http://127.0.0.1:{gport}"
    with running("bench/synthetic_providers.py", str(pport), "1", "2"), \
            running("-m", "services.gateway", env=env) as gateway:
        async def both_up() -> set[int]:
            pids = set()
            for _ in range(40):
                try:
                    r = _fresh(url, "/healthz")
                except httpx.TransportError:
                    return set()
                pids.add(r.json()["worker"]["pid"])
            return pids if len(pids) == 2 else set()

        pids = await eventually(both_up, timeout_s=120, what="both workers answering on the one port")
        answered = [_fresh(url, "/v1/search", json={"query": f"worker test {i}"}) for i in range(REQUESTS)]
        assert all(r.status_code == 200 for r in answered), [r.text for r in answered if r.status_code != 200]
        ids = {r.json()["trace_id"] for r in answered}
        metrics = _fresh(url, "/metrics").text  # whichever worker answers, it counts both
        line = next(ln for ln in metrics.splitlines() if ln.startswith('fanroute_gateway_requests_total{'))
        assert float(line.split()[-1]) == REQUESTS, line

        async def all_on_topic() -> bool:
            seen = {t.trace_id async for t in read_topic(kafka, topic("traces"), model=Trace)}
            return ids | {"left-by-single", "left-by-worker-3"} <= seen

        await eventually(all_on_topic, timeout_s=60, what="every answered and every adopted trace on the topic")
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=60) == 0
    for pid in pids:  # no worker outlives the supervisor
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for directory in (spool, spool / "worker-0", spool / "worker-1", spool / "worker-3"):
        s = Spool(directory, "traces")
        assert s.open() == [], directory  # unlocked (closed) and empty
        s.close()


async def test_back_to_one_process_the_gateway_publishes_what_it_and_the_workers_left(kafka_bootstrap, tmp_path):
    """One gateway (Kafka required at start) re-publishes its own spool at once (it used to wait for the next
    spooled trace) and adopts what the workers of an earlier run left."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"gw{uuid.uuid4().hex[:8]}.")
    spool = tmp_path / "spool"
    bus = Bus(kafka, client_id="test")
    _leave_spooled(spool, "left-by-this-one", bus)
    _leave_spooled(spool / "worker-1", "left-by-worker-1", bus)
    pport, gport = free_port(), free_port()
    providers = [{"type": "searxng", "name": "p0", "base_url": f"http://127.0.0.1:{pport}/p0", "timeout_s": 5}]
    env = service_env(kafka, "memory://", FANROUTE_PORT=str(gport), FANROUTE_PROVIDERS=json.dumps(providers),
                      FANROUTE_SPOOL_DIR=str(spool), FANROUTE_REQUIRE_KAFKA_AT_START="true")
    with running("-m", "services.gateway", env=env) as gateway:
        async def on_topic() -> bool:
            seen = {t.trace_id async for t in read_topic(kafka, topic("traces"), model=Trace)}
            return {"left-by-this-one", "left-by-worker-1"} <= seen

        await eventually(on_topic, timeout_s=90, what="both spooled traces on the topic, with no request made")
        await eventually(lambda: _up(f"http://127.0.0.1:{gport}"), timeout_s=60, what="the gateway serving")
        gateway.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM, not a crash
        assert gateway.wait(timeout=60) == -signal.SIGTERM
    for directory in (spool, spool / "worker-1"):
        s = Spool(directory, "traces")
        assert s.open() == [], directory
        s.close()
