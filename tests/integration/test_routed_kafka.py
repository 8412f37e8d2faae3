"""Routed mode on the real broker and redis-server: a trained adapter, published and promoted through the
real publisher and served by the real CPU sampler, picks the provider; the slice fans out; a stopped
sampler is a counted fallback to the best single provider; a new promotion is followed without restart.

The router is a tiny random Llama whose LoRA the real trainer fits (60 steps, well under a second) on
episodes that all give one ordering, so its greedy answer names that ordering: v1 learns
``alpha > beta > gamma`` and v2 ``gamma > beta > alpha``, which makes the switch visible in
``route.called``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from schemas import AdapterPublished, Trace, topic
from schemas.episode import Episode, RewardComponent
from services.common.bus import Bus
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_messages
from services.common.settings import KafkaSettings, RedisSettings
from services.gateway.app import Gateway, build_gateway, create_app
from services.gateway.follow import PromotedFollower
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from services.router.policy import in_fanout_slice
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from services.trainer.settings import TrainerSettings
from services.trainer.train import train
from tests.support.fakes import StaticProvider
from tests.support.records import episode
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_tiny_model

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

PROVIDERS = ("alpha", "beta", "gamma")
FALLBACK = "beta"  # the best single provider the promotion names
SLICE = 0.3
WORDS = "protein heart mouse cells effect study search query model wing library".split()
ORDERINGS = {1: "alpha > beta > gamma", 2: "gamma > beta > alpha"}


def routing_episodes(answer: str, n: int = 120) -> list[Episode]:
    """``n`` episodes over PROVIDERS whose judged ordering is always ``answer``."""
    return [episode(f"{WORDS[i % 11]} {WORDS[(i * 3 + 1) % 11]} {i}", answer, PROVIDERS, f"ep{i}", trace_id=f"tr{i}",
                    created_at=datetime(2026, 1, 1, tzinfo=UTC),
                    rewards=[RewardComponent(component_id=f"c{i}", name="ndcg:test:0", value=1.0)])
            for i in range(n)]


def train_and_publish(base: Path, out: Path, answer: str, publisher_url: str) -> int:
    """Fit a LoRA on ``answer`` with the real trainer, publish it as ``router``; returns the version."""
    settings = TrainerSettings(base_model=str(base), output_dir=out, eval_fraction=0.0, eval_every=0,
                               checkpoint_every=0, batch_size=2, lr=1e-2, lr_schedule="constant", max_steps=60,
                               allow_uncalibrated=True, publisher_url=publisher_url, model_id="router",
                               lora={"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": [
                                   "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    result = train(settings, episodes=routing_episodes(answer), gate_lookup=lambda key, providers: None,
                   out=lambda line: None)
    return result.published["version"]


async def promote(publisher_url: str, version: int) -> None:
    def call() -> None:
        with PublisherClient(publisher_url) as client:
            client.promote("router", version, fallback_provider=FALLBACK, evidence={"test": True})

    await asyncio.to_thread(call)  # the client is synchronous; this loop serves the publisher


def request_ids(inside: bool, n: int, tag: str) -> list[str]:
    return [k for k in (f"{tag}-{i}" for i in range(200)) if in_fanout_slice(k, SLICE) == inside][:n]


async def search(client: httpx.AsyncClient, request_id: str, i: int) -> dict:
    r = await client.post("/v1/search", json={"query": f"{WORDS[i % 11]} {WORDS[(i * 5 + 2) % 11]} {900 + i}",
                                              "request_id": request_id})
    assert r.status_code == 200, r.text
    return r.json()


def fallbacks(gw: Gateway, reason: str) -> float:
    return gw.metrics.registry.get_sample_value("fanroute_gateway_route_fallbacks_total", {"reason": reason}) or 0.0


async def test_routed_mode_end_to_end(kafka_bootstrap, redis_url, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="services.gateway.follow")
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"rt{uuid.uuid4().hex[:8]}.")
    redis = RedisSettings(url=redis_url)
    base = await asyncio.to_thread(build_tiny_model, tmp_path / "base")
    pport, sport = free_port(), free_port()
    pub_url, router_url = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{sport}"
    publisher = served(publisher_app(PublisherSettings(
        kafka=kafka, redis=redis, storage_dir=tmp_path / "store", public_url=pub_url)), pport,
        what="publisher", start_timeout_s=120)
    sampler = contextlib.AsyncExitStack()  # the sampler is stopped halfway through
    settings = GatewaySettings(kafka=kafka, redis=redis, providers=[BM25Config(name=n) for n in PROVIDERS],
                               deadline_s=30.0, routing={
                                   "enabled": True, "router_url": router_url, "fanout_fraction": SLICE,
                                   "router_timeout_s": 15.0, "poll_s": 300.0,  # v2 must come from the topic
                                   "group_id": f"gateway-{uuid.uuid4().hex[:8]}"})
    providers = [StaticProvider(n, (f"https://{n}.example/1", f"https://{n}.example/2")) for n in PROVIDERS]
    answers: dict[str, dict] = {}

    async with publisher, sampler:
        await sampler.enter_async_context(served(sampler_app(SamplerSettings(
            kafka=kafka, redis=redis, base_model=str(base), adapter_cache_dir=tmp_path / "cache",
            publisher_url=pub_url, group_id=f"sampler-{uuid.uuid4().hex[:8]}")), sport, what="sampler",
            start_timeout_s=120))
        v1 = await asyncio.to_thread(train_and_publish, base, tmp_path / "v1", ORDERINGS[1], pub_url)
        await promote(pub_url, v1)
        gw = build_gateway(settings, providers=providers)
        await gw.start()  # reads the promoted key from Redis
        try:
            assert gw.routed.follower.current.router == "router@1"
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, gateway=gw)),
                                       base_url="http://gw", timeout=60)

            # v1 routes: only the top of its ordering answers
            routed_v1 = [await search(client, rid, i) for i, rid in enumerate(request_ids(False, 3, "a"))]
            for body in routed_v1:
                assert body["mode"] == "routed" and body["route"]["fallback"] is None, body["route"]
                assert body["route"]["router"] == "router@1"
                assert body["route"]["ordering"][0] == "alpha" and body["route"]["called"] == ["alpha"]
                assert [c["provider"] for c in body["candidates"]] == ["alpha"]

            # the slice fans out to every provider and never asks the router
            fanned = [await search(client, rid, i) for i, rid in enumerate(request_ids(True, 2, "a"))]
            assert [(b["mode"], len(b["candidates"]), b["route"]) for b in fanned] == [("fanout", 3, None)] * 2

            # v2 is promoted: followed from the adapters topic without a restart
            v2 = await asyncio.to_thread(train_and_publish, base, tmp_path / "v2", ORDERINGS[2], pub_url)
            await promote(pub_url, v2)
            await gw.routed.follower.wait_for(lambda p: p is not None and p.version == v2, 30)
            assert "routing with router@2 (fallback provider beta; from topic)" in caplog.text
            routed_v2 = [await search(client, rid, i) for i, rid in enumerate(request_ids(False, 3, "b"))]
            for body in routed_v2:
                assert body["route"]["router"] == "router@2" and body["route"]["fallback"] is None, body["route"]
                assert body["route"]["called"] == ["gamma"]

            # the sampler goes away: the best single provider answers, counted by reason
            await sampler.aclose()
            down = [await search(client, rid, i) for i, rid in enumerate(request_ids(False, 2, "c"))]
            for body in down:
                assert body["mode"] == "routed" and body["route"]["router"] == "router@2"
                assert body["route"]["fallback"] in ("router_error", "router_timeout")
                assert body["route"]["called"] == [FALLBACK] and body["route"]["fallback_provider"] == FALLBACK
            assert fallbacks(gw, "router_error") + fallbacks(gw, "router_timeout") == 2
            assert gw.metrics.registry.get_sample_value("fanroute_gateway_router_version") == 2
            await client.aclose()
        finally:
            await gw.stop()

        # garbage on the adapters topic and another model's promotion do not derail a replay
        raw = Bus(kafka)
        await raw.start((topic("adapters"),))
        try:
            await raw.publish_raw(raw.name(topic("adapters")), b"{not json", key=b"router", headers={})
            await raw.publish(topic("adapters"), AdapterPublished(
                model_id="other", version=9, base_model="tiny", url="http://pub/other/9", files_sha256={},
                published_at=datetime.now(UTC), promoted=True))
        finally:
            await raw.stop()
        # a replica that starts with Redis empty replays the topic: the latest promotion is v2
        fresh = PromotedFollower("router", Bus(kafka), stamps=None, poll_s=300.0, group_id="unused")
        await fresh.start()
        assert fresh.current.router == "router@2"

    for body in routed_v1 + fanned + routed_v2 + down:
        answers[body["trace_id"]] = body
    traces = [t async for t in read_messages(kafka, topic("traces"), Trace, limit=len(answers), idle_s=10)]
    assert sorted(t.trace_id for t in traces) == sorted(answers)
    for t in traces:
        body = answers[t.trace_id]
        assert t.mode == body["mode"] and t.router_version == (body["route"] or {}).get("router")
        assert [c.provider for c in t.candidates] == [c["provider"] for c in body["candidates"]]
        assert t.route is None or list(t.route.called) == body["route"]["called"]
        assert not (t.mode == "routed" and t.signals.contested)
