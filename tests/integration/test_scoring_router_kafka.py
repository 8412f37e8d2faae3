"""The scoring router on the real broker and redis-server, against a local server speaking vLLM's
documented ``/v1/completions`` response shape (``prompt_logprobs``): the promotion arrives on the
adapters topic, the gateway scores every provider in one call, chooses by P(best) − λ · cost, and the
routed trace on the topic carries the scores and λ. (The same request against the real CPU sampler:
tests/integration/test_routed_kafka.py, which routes in the default scoring mode.)"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from schemas import AdapterPublished, Trace, topic
from services.common.bus import Bus
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from tests.support.fakes import StaticProvider
from tests.support.http_fake import ScriptedServer, scored_completion
from tests.support.poll import eventually

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

COST = {"deep": 0.004, "cheap": 0.001, "other": 0.001}
SCORES = {"deep": math.log(0.6), "cheap": math.log(0.3), "other": math.log(0.1)}


@pytest.mark.parametrize(("cost_weight", "chosen"), [(0.0, "deep"), (200.0, "cheap")])
async def test_the_gateway_routes_by_score_on_the_real_broker(kafka_bootstrap, redis_url, cost_weight, chosen):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"score{uuid.uuid4().hex[:8]}.")
    providers = [StaticProvider(n, (f"https://{n}.example/1",), cost_usd=c) for n, c in COST.items()]
    with ScriptedServer("vllm") as vllm:
        settings = GatewaySettings(kafka=kafka, redis=RedisSettings(url=redis_url),
                                   providers=[BM25Config(name=n) for n in COST], routing={
                                       "enabled": True, "router_url": vllm.url(), "fanout_fraction": 0.0,
                                       "mode": "score", "cost_weight": cost_weight,
                                       "group_id": f"gw-{uuid.uuid4().hex[:8]}"})
        gw = build_gateway(settings, providers=providers)
        await gw.start()
        try:
            bus = Bus(kafka)
            await bus.start((topic("adapters"),))
            try:
                await bus.publish(topic("adapters"), AdapterPublished(
                    model_id="router", version=4, base_model="SmolLM2-135M-Instruct", url="http://pub/router/4",
                    files_sha256={}, published_at=datetime.now(UTC), promoted=True, fallback_provider="other"))
            finally:
                await bus.stop()
            await gw.routed.follower.wait_for(lambda p: p is not None and p.version == 4, 30)
            vllm.script("/v1/completions", scored_completion(SCORES, model="router@4", shuffle=True))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, gateway=gw)),
                                         base_url="http://gw") as client:
                r = await client.post("/v1/search", json={"query": "heat transfer in a boundary layer",
                                                          "request_id": f"r-{cost_weight}"})
            assert r.status_code == 200, r.text
            body = r.json()
        finally:
            await gw.stop()
        [req] = vllm.received
    assert req.json["model"] == "router@4" and req.json["prompt_logprobs"] == 0 and len(req.json["prompt"]) == 3
    assert [p.rsplit("\n", 1)[1] for p in req.json["prompt"]] == list(COST)  # one prompt per name, in order
    assert body["route"]["called"] == [chosen] and body["route"]["fallback"] is None
    assert [c["provider"] for c in body["candidates"]] == [chosen]

    async def on_topic() -> list[Trace]:
        return [t async for t in read_topic(kafka, topic("traces"), model=Trace)]

    [trace] = await eventually(on_topic, timeout_s=30, what="the routed trace on the traces topic")
    assert trace.trace_id == body["trace_id"] and trace.mode == "routed" and trace.router_version == "router@4"
    assert trace.route.scores == pytest.approx(SCORES, abs=1e-6) and trace.route.cost_weight == cost_weight
    assert trace.route.ordering[0] == chosen and trace.route.called == (chosen,)
