"""The bus against the real Apache Kafka broker: once, in order per key, poison to the DLQ."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import Trace, topic
from services.common.bus import Bus, dead_letter_from_record
from services.common.settings import KafkaSettings
from tests.support.records import trace

pytestmark = pytest.mark.kafka


def _settings(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"t{uuid.uuid4().hex[:10]}.")


async def _read_all(bootstrap: str, name: str, n: int, timeout_s: float = 30) -> list:
    """Read ``n`` records from ``name`` (from the beginning, no group)."""
    consumer = AIOKafkaConsumer(name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=None, enable_auto_commit=False)
    await consumer.start()
    out: list = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(out) < n:
                for recs in (await consumer.getmany(timeout_ms=500)).values():
                    out.extend(recs)
    finally:
        await consumer.stop()
    return out


async def test_published_messages_are_consumed_once_in_order_per_key(kafka_bootstrap):
    settings = _settings(kafka_bootstrap)
    producer_bus, consumer_bus = Bus(settings), Bus(settings)
    keys = [f"k{i}" for i in range(5)]
    sent = [trace(trace_id=keys[i % 5], query=f"q{i:03d}") for i in range(60)]
    got: dict[str, list[str]] = defaultdict(list)
    done = asyncio.Event()

    async def handle(t: Trace) -> None:
        got[t.trace_id].append(t.query)
        if sum(map(len, got.values())) == len(sent):
            done.set()

    consumer_bus.subscribe(topic("traces"), handle, group_id="g1")
    await producer_bus.start((topic("traces"),))
    for t in sent:
        await producer_bus.publish(topic("traces"), t)
    await consumer_bus.start((topic("traces"),))
    try:
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await consumer_bus.stop()
        await producer_bus.stop()
    for k in keys:
        assert got[k] == [t.query for t in sent if t.trace_id == k]  # once each, in order


async def test_poison_messages_go_to_dlq_with_reason_and_bytes_and_consumer_goes_on(kafka_bootstrap):
    settings = _settings(kafka_bootstrap)
    bus = Bus(settings)
    name = bus.name(topic("traces"))
    good = trace("after-poison")
    wrong_version = json.loads(trace("v9").to_bytes()) | {"schema_version": 9}
    poison = [b"\xff\xfenot json", json.dumps(wrong_version).encode(), b'{"schema_version": 1}']
    seen: list[str] = []
    arrived = asyncio.Event()

    async def handle(t: Trace) -> None:
        seen.append(t.trace_id)
        arrived.set()

    bus.subscribe(topic("traces"), handle, group_id="g-poison")
    await bus.start((topic("traces"),))
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for raw in poison:
            await producer.send_and_wait(name, raw, key=b"p")
        await producer.send_and_wait(name, good.to_bytes(), key=b"p")
        await asyncio.wait_for(arrived.wait(), 60)
        dead = [dead_letter_from_record(r) for r in await _read_all(kafka_bootstrap, f"{name}.dlq", 3)]
    finally:
        await producer.stop()
        await bus.stop()
    assert seen == ["after-poison"]
    assert [d.original for d in dead] == poison
    assert "not valid JSON" in dead[0].reason
    assert "schema_version 9 is not one this build reads" in dead[1].reason
    assert "Field required" in dead[2].reason
    assert {d.source_topic for d in dead} == {name} and {d.consumer for d in dead} == {"g-poison"}
    assert [d.source_offset for d in dead] == [0, 1, 2]


async def test_handler_that_keeps_failing_is_dead_lettered_after_retries(kafka_bootstrap):
    settings = _settings(kafka_bootstrap)
    bus = Bus(settings)
    attempts: list[str] = []
    ok = asyncio.Event()

    async def handle(t: Trace) -> None:
        attempts.append(t.trace_id)
        if t.trace_id == "bad":
            raise RuntimeError("downstream is broken")
        ok.set()

    bus.subscribe(topic("traces"), handle, group_id="g-retry", max_attempts=3, retry_backoff_s=0.01)
    await bus.start((topic("traces"),))
    try:
        await bus.publish(topic("traces"), trace("bad"))
        await bus.publish(topic("traces"), trace("good"))
        await asyncio.wait_for(ok.wait(), 60)
        [rec] = await _read_all(kafka_bootstrap, bus.dlq_name(topic("traces")), 1)
    finally:
        await bus.stop()
    # the two ids sit on different partitions, so which comes first is up to the fetch;
    # the three attempts at "bad" are back to back either way
    assert sorted(attempts) == ["bad", "bad", "bad", "good"] and "bad,bad,bad" in ",".join(attempts)
    dl = dead_letter_from_record(rec)
    assert dl.reason == "downstream is broken" and dl.error_type == "RuntimeError"
    assert Trace.model_validate_json(dl.original).trace_id == "bad"


async def test_topics_are_created_with_registry_partitions(kafka_bootstrap):
    from aiokafka.admin import AIOKafkaAdminClient

    settings = _settings(kafka_bootstrap)
    bus = Bus(settings)
    await bus.start((topic("traces"), topic("adapters")))
    await bus.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        meta = await admin.describe_topics([bus.name(topic("traces")), bus.name(topic("adapters"))])
    finally:
        await admin.close()
    parts = {m["topic"]: len(m["partitions"]) for m in meta}
    assert parts == {bus.name(topic("traces")): 6, bus.name(topic("adapters")): 1}


@pytest.mark.parametrize("codec", ["none", "lz4", "zstd", "gzip"])
async def test_large_traces_round_trip_compressed_in_big_batches(kafka_bootstrap, codec):
    """Traces of ≈ 60 KB (a demo market's size is ≈ 55 KB) with each codec and 512 KiB batches arrive
    whole and once: the producer settings the gateway's request path depends on."""
    from tests.support.records import candidate

    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"t{uuid.uuid4().hex[:10]}.",
                             compression=codec, max_batch_bytes=524_288)
    bus = Bus(settings)
    await bus.start((topic("traces"),))
    text = "retrieval routing " * 1700  # ≈ 30 KB per candidate's answer
    sent = [trace(trace_id=f"big{i}", candidates=(candidate("a", answer=text), candidate("b", answer=text)))
            for i in range(12)]
    try:
        await asyncio.gather(*(bus.publish(topic("traces"), t) for t in sent))
    finally:
        await bus.stop()
    records = await _read_all(kafka_bootstrap, bus.name(topic("traces")), len(sent))
    got = sorted((Trace.model_validate_json(r.value) for r in records), key=lambda t: t.trace_id)
    assert [t.trace_id for t in got] == sorted(t.trace_id for t in sent)
    assert all(len(r.value) > 60_000 for r in records) and got[0].candidates[0].answer == text


async def test_a_latest_subscriber_once_positioned_delivers_what_is_published_next(kafka_bootstrap):
    """``Bus.positioned``: after it, a ``latest`` subscriber has its offset, so the next record is not skipped
    (the gateway's promotion follower waits for it before its start returns)."""
    settings = _settings(kafka_bootstrap)
    producer_bus, consumer_bus = Bus(settings), Bus(settings)
    got: list[str] = []
    arrived = asyncio.Event()

    async def handle(t: Trace) -> None:
        got.append(t.trace_id)
        arrived.set()

    tail = consumer_bus.subscribe(topic("traces"), handle, group_id=f"g-{uuid.uuid4().hex[:8]}",
                                  auto_offset_reset="latest")
    assert not await consumer_bus.positioned(tail, 5)  # not started: nothing to wait for
    await producer_bus.start((topic("traces"),))
    await producer_bus.publish(topic("traces"), trace(trace_id="before"))
    await consumer_bus.start((topic("traces"),))
    try:
        assert await consumer_bus.positioned(tail, 30)
        assert tail.consumer.assignment()
        await producer_bus.publish(topic("traces"), trace(trace_id="after"))
        await asyncio.wait_for(arrived.wait(), 30)
    finally:
        await consumer_bus.stop()
        await producer_bus.stop()
    assert got == ["after"]  # "before" came before the subscriber's offset: latest skips it
