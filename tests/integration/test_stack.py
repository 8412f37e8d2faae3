"""The session's Kafka broker takes a produce and serves it back; its Redis answers SET/GET."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


async def test_kafka_accepts_a_produce_and_a_group_consume(kafka_bootstrap, topic_name):
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic_name, b"hello", key=b"k1")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=kafka_bootstrap,
                                group_id=f"{topic_name}.group", auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=60)
        await consumer.commit()  # the group coordinator (__consumer_offsets, RF 1) works too
    finally:
        await consumer.stop()
    assert (record.key, record.value) == (b"k1", b"hello")
    assert (record.partition, record.offset) == (sent.partition, sent.offset)


async def test_redis_answers_set_and_get(redis_url):
    client = aioredis.from_url(redis_url)
    key = f"test:stack:{uuid.uuid4().hex}"
    try:
        assert await client.set(key, "v1", ex=60)
        assert await client.get(key) == b"v1"
    finally:
        await client.delete(key)
        await client.aclose()
