"""The linear router as a servable kind, on the real broker and redis-server: fitted by ``fanroute linear
fit``, published and promoted through the real publisher (stamped like an adapter), served in-process by
the gateway in routed mode with ``routing.kind = linear``; a bad artifact is a
counted fallback to the best single provider.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from services.cli import main
from services.common.adapter_files import LINEAR_ARTIFACT, content_digest
from services.common.dataset import write_jsonl
from services.common.publisher_client import PublisherClient
from services.common.settings import KafkaSettings, RedisSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from tests.support.fakes import StaticProvider
from tests.support.records import episode
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

PROVIDERS = ("aero", "biomed", "web")
FALLBACK = "web"
TOPICS = {"aero": "supersonic wing flow shock airfoil mach boundary layer flutter".split(),
          "biomed": "protein heart cells mouse tumour enzyme liver patients drug".split()}


def _episodes() -> list:
    out = []
    for label, words in TOPICS.items():
        for i in range(24):
            q = f"{words[i % len(words)]} {words[(i * 3 + 1) % len(words)]} study {i}"
            out.append(episode(q, f"{label} > {FALLBACK}", PROVIDERS, f"{label}{i}", trace_id=f"t-{label}{i}",
                               created_at=datetime(2026, 1, 1, tzinfo=UTC)))
    return out


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_the_linear_router_is_published_promoted_and_served_in_process(kafka_bootstrap, redis_url, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"lin{uuid.uuid4().hex[:8]}.")
    redis = RedisSettings(url=redis_url)
    write_jsonl(_episodes(), tmp_path / "train.jsonl")
    pport = free_port()
    pub_url = f"http://127.0.0.1:{pport}"
    settings = GatewaySettings(kafka=kafka, redis=redis, providers=[BM25Config(name=n) for n in PROVIDERS],
                               deadline_s=30.0, routing={
                                   "enabled": True, "kind": "linear", "publisher_url": pub_url,
                                   "fanout_fraction": 0.0, "router_timeout_s": 10.0, "poll_s": 300.0,
                                   "group_id": f"gateway-{uuid.uuid4().hex[:8]}"})
    providers = [StaticProvider(n, (f"https://{n}.example/1",)) for n in PROVIDERS]
    async with served(publisher_app(PublisherSettings(kafka=kafka, redis=redis, storage_dir=tmp_path / "store",
                                                      public_url=pub_url)), pport, what="publisher",
                      start_timeout_s=120):
        # fit and publish with the command line, as an operator would; then promote it
        assert await _cli("linear", "fit", "--train-episodes", str(tmp_path / "train.jsonl"), "--out",
                          str(tmp_path / "lin"), "--publisher-url", pub_url, "--model-id", "router") == 0
        artifact = json.loads((tmp_path / "lin" / LINEAR_ARTIFACT).read_text())
        assert artifact["labels"] == {"aero": 24, "biomed": 24}

        def promote(version: int) -> dict:
            with PublisherClient(pub_url) as client:
                assert client.stamp("router") == version  # stamped in Redis like an adapter
                client.promote("router", version, fallback_provider=FALLBACK, evidence={"test": True})
                return client.manifest("router", version)

        manifest = await asyncio.to_thread(promote, 1)
        assert set(manifest["files_sha256"]) == {LINEAR_ARTIFACT}
        gw = build_gateway(settings, providers=providers)
        await gw.start()
        try:
            assert gw.routed.follower.current.router == "router@1"
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, gateway=gw)),
                                       base_url="http://gw", timeout=60)
            for query, want in (("shock wave over a supersonic airfoil", "aero"),
                                ("enzyme activity in mouse liver cells", "biomed")):
                r = await client.post("/v1/search", json={"query": query, "request_id": f"r-{want}"})
                body = r.json()
                assert r.status_code == 200 and body["mode"] == "routed", body
                route = body["route"]
                assert route["router"] == "router@1" and route["fallback"] is None, route
                assert route["called"] == [want] and set(route["scores"]) == set(PROVIDERS)
                assert route["router_ms"] < 1000  # in-process: no model server between
                # named by content, as an adapter is: the manifest's digest (no trace of it before)
                assert route["router_sha256"] == content_digest(manifest["files_sha256"]), route

            # a version whose artifact is damaged (valid JSON, wrong shape) is a counted fallback
            bad = tmp_path / "bad"
            bad.mkdir()
            broken = dict(artifact, coef=[[0.0]])
            (bad / LINEAR_ARTIFACT).write_text(json.dumps(broken))

            def publish_bad() -> int:
                with PublisherClient(pub_url) as c:
                    v = c.publish("router", bad, "tfidf+logreg", {})["version"]
                    c.promote("router", v, fallback_provider=FALLBACK, evidence={"test": True})
                    return v

            v2 = await asyncio.to_thread(publish_bad)
            await gw.routed.follower.wait_for(lambda p: p is not None and p.version == v2, 30)
            r = await client.post("/v1/search", json={"query": "supersonic wing", "request_id": "r-bad"})
            route = r.json()["route"]
            assert r.status_code == 200 and route["fallback"] == "router_error", route
            assert route["called"] == [FALLBACK]
            assert gw.metrics.registry.get_sample_value("fanroute_gateway_route_fallbacks_total",
                                                        {"reason": "router_error"}) == 1
            await client.aclose()
        finally:
            await gw.stop()

