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
    async def publish(self, spec, message) -> None:
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
    assert r.headers["X-Fanroute-Trace"] == "published" and body["trace_published"] is True
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


async def test_request_id_makes_trace_id_stable(gw_client):
    client, *_ = gw_client
    ids = [(await client.post("/v1/search", json={"query": "q", "request_id": "r-1"})).json()["trace_id"]
           for _ in range(2)]
    other = (await client.post("/v1/search", json={"query": "q", "request_id": "r-2"})).json()["trace_id"]
    assert ids[0] == ids[1] != other


@pytest.mark.parametrize("gw_client", [FailingBus], indirect=True)
async def test_unacknowledged_trace_is_reported_not_hidden(gw_client):
    client, gw, *_ = gw_client
    r = await client.post("/v1/search", json={"query": "q"})
    assert r.status_code == 200
    assert r.headers["X-Fanroute-Trace"] == "unpublished"
    assert r.json()["trace_published"] is False and "KafkaTimeoutError" in r.json()["trace_error"]
    assert "fanroute_traces_unpublished_total 1.0" in (await client.get("/metrics")).text


@pytest.mark.parametrize("payload, status, reason", [
    ({"query": ""}, 422, "must not be empty"),
    ({"query": "   \n\t "}, 422, "must not be empty"),
    ({"query": "x" * 51}, 413, "51 characters; the limit is 50"),
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
    assert r.status_code == 422 and "JSON decode error" in r.json()["reason"]
    r = await client.post("/v1/search", content=b'{"query": "' + b"x" * 4000 + b'"}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    assert all(p.calls == [] for p in gw.providers) and got == []
    metrics = (await client.get("/metrics")).text
    assert 'fanroute_gateway_rejected_total{reason="body_too_large"} 1.0' in metrics


async def test_healthz_metrics_and_openapi(gw_client):
    client, *_ = gw_client
    assert (await client.get("/healthz")).json() == {"status": "ok", "providers": ["a", "b", "c"],
                                                      "kafka": "memory"}
    await client.post("/v1/search", json={"query": "q"})
    m = (await client.get("/metrics")).text
    assert 'fanroute_provider_calls_total{outcome="error",provider="c"} 1.0' in m
    assert 'fanroute_gateway_requests_total{mode="fanout",status="ok"} 1.0' in m
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/search" in spec["paths"]
