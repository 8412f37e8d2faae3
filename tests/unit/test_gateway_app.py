"""The gateway's HTTP surface on the in-memory bus: answers, traces, metrics and bad input."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from schemas import Trace, topic
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from tests.support.fakes import StaticProvider, failing


def _settings(**kw) -> GatewaySettings:
    return GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                           providers=[BM25Config(name="unused")], **kw)


class FailingBus(Bus):
    async def publish_raw(self, topic, value, *, key, headers, timeout_s="setting") -> None:
        raise BusError("publish to traces failed: KafkaTimeoutError")


@pytest.fixture
async def gw_client(request):
    bus_cls = getattr(request, "param", Bus)
    settings = _settings(max_query_chars=50, max_body_bytes=2048)
    providers = [StaticProvider("a", ("u1", "u2")), StaticProvider("b", ("u2", "u3")), failing("c")]
    gw = build_gateway(settings, bus=bus_cls(settings.kafka), providers=providers)
    got: list[Trace] = []
    arrived = asyncio.Event()

    async def on_trace(t: Trace) -> None:
        got.append(t)
        arrived.set()

    gw.bus.subscribe(topic("traces"), on_trace, group_id="test")
    await gw.start()
    app = create_app(settings, gateway=gw)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        yield client, gw, got, arrived
    await gw.stop()


async def test_search_answers_with_every_candidate_and_publishes_trace(gw_client):
    client, gw, got, arrived = gw_client
    r = await client.post("/v1/search", json={"query": "  what   is a cell ", "query_id": "med/1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["X-Fanroute-Trace"] == "published" and body["trace_status"] == "published"
    assert body["trace_published"] is True  # deprecated, derived from trace_status
    assert body["query"] == "what is a cell"
    timing = dict(part.strip().split(";dur=") for part in r.headers["Server-Timing"].split(","))
    assert set(timing) == {"fanout", "slowest-provider", "gateway"} and float(timing["gateway"]) >= 0
    assert [c["provider"] for c in body["candidates"]] == ["a", "b", "c"]
    assert body["candidates"][2]["error"].endswith("upstream exploded")
    assert body["fused"][0]["url"] == "u2" and body["fused"][0]["providers"] == {"a": 2, "b": 1}
    assert body["signals"]["pairwise_overlap"] == {"a|b": pytest.approx(1 / 3, abs=1e-6)}
    await asyncio.wait_for(arrived.wait(), 5)
    assert got[0].trace_id == body["trace_id"] and got[0].query_id == "med/1"
    assert got[0].mode == "fanout" and len(got[0].candidates) == 3
    assert all(p.calls == ["what is a cell"] for p in gw.providers)


async def test_request_id_makes_trace_id_stable_and_collision_free(gw_client):
    client, *_ = gw_client

    async def trace_id(**body) -> str:
        return (await client.post("/v1/search", json=body)).json()["trace_id"]

    retried = [await trace_id(query="q", request_id="r-1") for _ in range(2)]
    assert retried[0] == retried[1] == await trace_id(query="  q ", request_id="r-1")  # same query, normalised
    others = {await trace_id(query="q", request_id="r-2"),
              await trace_id(query="another query", request_id="r-1"),  # a reused request id: no collision
              await trace_id(query="q", request_id="r-1", query_id="med/1")}
    assert len(others) == 3 and retried[0] not in others
    assert await trace_id(query="q", request_id="r-1", query_id="med/1") in others  # that retry, stable


@pytest.mark.parametrize("gw_client", [FailingBus], indirect=True)
async def test_unacknowledged_trace_is_spooled_and_said_so(gw_client):
    client, gw, *_ = gw_client
    r = await client.post("/v1/search", json={"query": "q"})
    assert r.status_code == 200
    assert r.headers["X-Fanroute-Trace"] == "spooled"
    assert r.json()["trace_status"] == "spooled" and r.json()["trace_published"] is False
    assert "KafkaTimeoutError" in r.json()["trace_error"]
    metrics = (await client.get("/metrics")).text
    assert "fanroute_traces_spooled_total 1.0" in metrics and "fanroute_traces_unpublished_total 0.0" in metrics
    assert "fanroute_traces_spool_depth 1.0" in metrics
    assert gw.outbox.spool.depth == 1


@pytest.mark.parametrize("payload, status, reason", [
    ({"query": ""}, 422, "must not be empty"),
    ({"query": "   \n\t "}, 422, "must not be empty"),
    ({"query": "x" * 51}, 422, "51 characters; the limit is 50"),
    ({"query": 42}, 422, "query: Input should be a valid string"),
    ({"query": ["a"]}, 422, "query: Input should be a valid string"),
    ({}, 422, "query: Field required"),
    ({"query": "q", "extra": 1}, 422, "extra: Extra inputs are not permitted"),
])
async def test_bad_input_is_a_clear_4xx_and_publishes_nothing(gw_client, payload, status, reason):
    client, gw, got, _ = gw_client
    r = await client.post("/v1/search", json=payload)
    assert r.status_code == status
    assert reason in r.json()["reason"]
    assert all(p.calls == [] for p in gw.providers) and got == []


async def test_malformed_json_and_oversized_body(gw_client):
    client, gw, got, _ = gw_client
    r = await client.post("/v1/search", content=b'{"query": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json" and "not valid JSON" in r.json()["reason"]
    r = await client.post("/v1/search", content=b'{"query": "' + b"x" * 4000 + b'"}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    assert all(p.calls == [] for p in gw.providers) and got == []
    metrics = (await client.get("/metrics")).text
    assert 'fanroute_gateway_rejected_total{reason="body_too_large"} 1.0' in metrics


async def test_healthz_metrics_and_openapi(gw_client):
    client, *_ = gw_client
    health = (await client.get("/healthz")).json()
    spool = health.pop("spool")
    assert health == {"status": "ok", "providers": ["a", "b", "c"], "kafka": "memory",
                      "link": {"state": "memory", "bootstrap_servers": "memory://"}}
    assert spool["status"] == "ok" and spool["depth"] == 0 and spool["oldest_age_s"] == 0
    await client.post("/v1/search", json={"query": "q"})
    m = (await client.get("/metrics")).text
    assert 'fanroute_provider_calls_total{outcome="error",provider="c"} 1.0' in m
    assert 'fanroute_gateway_requests_total{mode="fanout",status="ok"} 1.0' in m
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/search" in spec["paths"]
