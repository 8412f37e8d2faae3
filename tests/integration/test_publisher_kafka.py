"""Adapters published through the running publisher land on the real ``adapters`` topic and move the
real Redis stamp; a sampler pulls them back verified."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis.asyncio as redis

from schemas import AdapterPublished, topic
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic_records
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import parse_promoted, promoted_key, stamp_key
from services.publisher.app import create_app
from services.publisher.settings import PublisherSettings
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def _adapter(root, tag: str):
    d = root / f"adapter-{tag}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (d / "adapter_model.safetensors").write_bytes(f"weights {tag}".encode() * 1000)
    return d


async def test_versions_reach_the_topic_and_move_the_redis_stamp(kafka_bootstrap, redis_url, tmp_path):
    ns = f"pub{uuid.uuid4().hex[:8]}."
    port = free_port()
    settings = PublisherSettings(
        kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns),
        redis=RedisSettings(url=redis_url), port=port, public_url=f"http://127.0.0.1:{port}",
        storage_dir=tmp_path / "store", serving_ttl_s=120)
    r = redis.Redis.from_url(redis_url)
    stamps = []
    try:
        async with served(create_app(settings), port, what="publisher", start_timeout_s=60):
            with PublisherClient(settings.public_url, timeout_s=30) as client:
                call = lambda f, *a, **kw: asyncio.to_thread(f, *a, **kw)  # noqa: E731 - sync client, our loop serves
                stamps.append(await call(client.stamp, "router"))
                v1 = await call(client.publish, "router", _adapter(tmp_path, "1"), "smollm2-135m", {"ndcg": 0.5})
                stamps.append(int(await r.get(stamp_key(ns, "router"))))
                second = _adapter(tmp_path, "2")
                v2 = await call(client.publish, "router", second, "smollm2-135m", {"ndcg": 0.6})
                stamps.append(int(await r.get(stamp_key(ns, "router"))))
                again = await call(client.publish, "router", second, "smollm2-135m", {})  # same content
                promoted = await call(client.promote, "router", 2, fallback_provider="bm25-all")
                promoted_record = await r.get(promoted_key(ns, "router"))
                await call(client.report_serving, "sampler-0", "router", 2)
                pulled = await call(client.fetch_url, v2["url"], tmp_path / "pulled",
                                    expect_sha256=v2["files_sha256"])
                final_stamp = await call(client.stamp, "router")
            ttl_ms = await r.pttl(f"fanroute:{ns}adapter:serving:router:sampler-0")
            records = [rec async for rec in read_topic_records(settings.kafka, topic("adapters"),
                                                               model=AdapterPublished, strict=True)]
    finally:
        await r.aclose()

    assert stamps == [0, 1, 2] and final_stamp == 2
    assert parse_promoted(promoted_record) == (2, "bm25-all")
    assert (v1["version"], v2["version"], again["version"]) == (1, 2, 2)
    assert promoted["promoted"] is True and promoted["version"] == 2
    messages = [rec.message for rec in records]
    assert [rec.key for rec in records] == [b"router"] * 3
    assert [(m.version, m.promoted) for m in messages] == [(1, False), (2, False), (2, True)]
    assert messages[1].model_dump(mode="json") == v2
    assert messages[1].url == f"{settings.public_url}/v1/adapters/router/versions/2"
    assert (pulled / "adapter_model.safetensors").read_bytes() == b"weights 2" * 1000
    assert 0 < ttl_ms <= 120_000
