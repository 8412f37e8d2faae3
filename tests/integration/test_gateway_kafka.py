"""A query sent to the running gateway comes back as a Trace from the real Kafka topic."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
import pytest

from services.common.settings import KafkaSettings
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import (
    BM25Config,
    DenseConfig,
    LatencyModel,
    SearxngConfig,
)
from services.tools.traces import read_traces
from tests.support.serving import free_port, served
from tests.unit.web_api_fakes import FakeApis, Reply, searxng_ok

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
QUERY = "the crystalline lens in vertebrates, including humans"  # MED query 1


@pytest.fixture
def fake_web():
    fake = FakeApis()
    fake.start()
    yield fake
    fake.stop()


async def test_search_lands_a_full_trace_on_kafka(kafka_bootstrap, fake_web, tmp_path_factory):
    fake_web.script("/searxng/search", Reply(200, searxng_ok()))
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"gw{uuid.uuid4().hex[:8]}.")
    cache = tmp_path_factory.mktemp("index-cache")
    settings = GatewaySettings(
        kafka=kafka, port=free_port(), cache_dir=cache,
        providers=[
            BM25Config(name="bm25-small", collections=("adi", "med"), cost_usd=0.001,
                       latency=LatencyModel(median_ms=20, sigma=0.2)),
            DenseConfig(name="dense-med", collections=("med",), cost_usd=0.004),
            BM25Config(name="adi-only", collections=("adi",), cost_usd=0.0005),
            SearxngConfig(name="searxng", base_url=fake_web.base_url("searxng"), cost_usd=0.0),
            SearxngConfig(name="searxng-down", base_url="http://127.0.0.1:9/", timeout_s=2, max_retries=0),
        ])
    since = datetime.now(UTC)
    async with served(create_app(settings), settings.port, what="gateway", start_timeout_s=600) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/v1/search", json={"query": QUERY, "query_id": "med/1"})
        assert r.status_code == 200, r.text
        assert r.headers["X-Fanroute-Trace"] == "published"
        body = r.json()
        traces = [t async for t in read_traces(kafka, limit=1, idle_s=30, since=since)]
    [t] = traces
    assert t.trace_id == body["trace_id"] and t.query == QUERY and t.query_id == "med/1"
    assert t.mode == "fanout" and t.router_version is None
    cands = {c.provider: c for c in t.candidates}
    assert list(cands) == ["bm25-small", "dense-med", "adi-only", "searxng", "searxng-down"]
    for name in ("bm25-small", "dense-med", "adi-only"):
        c = cands[name]
        assert c.ok and len(c.citations) == 10, (name, c.error)
        assert [x.rank for x in c.citations] == list(range(1, 11))
        assert all(x.url.startswith("collection://") and x.snippet for x in c.citations)
        assert c.latency_ms > 0 and c.answer
    assert cands["bm25-small"].latency_ms >= 10  # the latency model is applied
    assert all(x.url.startswith("collection://med/") for x in cands["dense-med"].citations)
    assert all(x.url.startswith("collection://adi/") for x in cands["adi-only"].citations)
    assert cands["dense-med"].cost_usd == 0.004
    assert [x.url for x in cands["searxng"].citations][0].startswith("https://en.wikipedia.org")
    down = cands["searxng-down"]
    assert not down.ok and down.error_kind and down.citations == () and down.cost_usd == 0
    s = t.signals
    assert s.providers_ok == 4 and s.providers_failed == 1
    assert set(s.pairwise_overlap) == {"adi-only|bm25-small", "adi-only|dense-med", "adi-only|searxng",
                                       "bm25-small|dense-med", "bm25-small|searxng", "dense-med|searxng"}
    assert s.pairwise_overlap["bm25-small|dense-med"] > 0  # lexical and dense agree on MED
    assert s.pairwise_overlap["adi-only|searxng"] == 0.0
    assert s.min_overlap == 0.0 and s.mean_overlap == pytest.approx(
        sum(s.pairwise_overlap.values()) / 6, abs=1e-5)
    assert s.contested == (s.mean_overlap < s.contested_threshold)
