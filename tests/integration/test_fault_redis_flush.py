"""Redis FLUSHALL mid-flow on the real redis-server: the publisher's stamp and promotion come back from its
manifests, and no version number ever names two contents on the real ``adapters`` topic; the relay's
episode credentials fail closed.

Before the publisher checked its stamps (``Publisher.reconcile``, ``_next_version``), the stamp restarted
at 0 after the flush and the next publish announced a second, different ``router@1``.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as redis

from schemas import AdapterPublished, topic
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import parse_promoted, promoted_key, stamp_key
from services.publisher.app import create_app
from services.publisher.settings import PublisherSettings
from tests.integration.test_publisher_kafka import _adapter
from tests.support import fault_matrix
from tests.support.poll import eventually
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


async def test_flushall_mid_flow_restores_the_stamp_and_never_reuses_a_version(kafka_bootstrap, redis_url,
                                                                                tmp_path, request):
    ns = f"flush{uuid.uuid4().hex[:8]}."
    port = free_port()
    settings = PublisherSettings(
        kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns),
        redis=RedisSettings(url=redis_url), port=port, public_url=f"http://127.0.0.1:{port}",
        storage_dir=tmp_path / "store", stamp_check_s=0.2)
    r = redis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(120), served(create_app(settings), port, what="publisher", start_timeout_s=60):
            with PublisherClient(settings.public_url, timeout_s=30) as client:
                call = lambda f, *a, **kw: asyncio.to_thread(f, *a, **kw)  # noqa: E731 - sync client, our loop serves
                for tag in ("1", "2"):
                    await call(client.publish, "router", _adapter(tmp_path, tag), "smollm2-135m", {})
                await call(client.promote, "router", 2, fallback_provider="bm25-all")
                await r.flushall()  # Redis loses everything mid-flow
                assert await r.get(stamp_key(ns, "router")) is None

                async def restored() -> bool:
                    stamp = await r.get(stamp_key(ns, "router"))
                    return stamp is not None and int(stamp) == 2 and \
                        parse_promoted(await r.get(promoted_key(ns, "router"))) == (2, "bm25-all")

                await eventually(restored, timeout_s=30, what="the stamp and promotion restored from the manifests")
                await r.flushall()  # and again, right before a publish
                v3 = await call(client.publish, "router", _adapter(tmp_path, "3"), "smollm2-135m", {})
                assert v3["version"] == 3 and int(await r.get(stamp_key(ns, "router"))) == 3
    finally:
        await r.aclose()
    msgs = [m async for m in read_topic(settings.kafka, topic("adapters"), model=AdapterPublished)]
    contents: dict[int, set] = {}
    for m in msgs:
        contents.setdefault(m.version, set()).add(tuple(sorted(m.files_sha256.items())))
    row = fault_matrix.report(fault_matrix.count(
        "Redis FLUSHALL twice mid-flow (after a promotion; right before a publish)", "publisher stamps",
        fault_matrix.test_id(request), records_in=3, expected=["1", "2", "3"],
        results=[str(v) for v in sorted(contents)], announcements=len(msgs)))
    assert all(len(c) == 1 for c in contents.values()), contents  # no version names two contents
    assert sorted(contents) == [1, 2, 3] and row.lost == 0


async def test_flushall_fails_the_relays_credentials_closed(redis_url):
    """After Redis loses its data no episode credential opens anything: a live token and an expired one are
    both refused 401 (never let through, never bound to another episode), and a token minted afterwards
    opens its own episode only."""
    from services.relay.credentials import RedisCredentialStore

    clock = [1_000.0]
    ns = f"flushcred{uuid.uuid4().hex[:8]}."
    store = RedisCredentialStore(redis_url, ns, clock=lambda: clock[0])
    r = redis.Redis.from_url(redis_url)
    try:
        live = await store.mint("ep-a", ttl_s=600)
        expired = await store.mint("ep-b", ttl_s=5)
        clock[0] += 10
        assert await store.check(live, "ep-a") is None
        assert (await store.check(expired, "ep-b")).kind == "expired_credential"
        await r.flushall()
        for token, trace in ((live, "ep-a"), (live, "ep-b"), (expired, "ep-b"), (expired, "ep-a")):
            refusal = await store.check(token, trace)
            assert refusal is not None and (refusal.status, refusal.kind) == (401, "unknown_credential"), trace
        fresh = await store.mint("ep-c", ttl_s=600)
        assert await store.check(fresh, "ep-c") is None and (await store.check(fresh, "ep-a")).status == 403
    finally:
        await store.close()
        await r.aclose()
