"""Read topics without a consumer group (never moving any service's offsets).

:func:`read_to_end` rebuilds state from everything on a topic now; :func:`read_messages` follows
a topic from a point in time, for tools and tests that watch results arrive.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, TypeVar

from schemas.base import Message, decode
from schemas.topics import TopicSpec
from services.common.errors import SchemaError
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


async def read_to_end(settings: KafkaSettings, name: str) -> AsyncIterator[bytes]:
    """Every record value of topic ``name`` that exists now."""
    async for rec in read_records_to_end(settings, name):
        yield rec.value


async def read_records_to_end(settings: KafkaSettings, name: str) -> AsyncIterator[Any]:
    """Every record (aiokafka ConsumerRecord: value, key, timestamp, partition, offset) of
    topic ``name`` that exists now; within a partition in offset order."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(name, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = list(consumer.assignment())
        if not tps:
            return
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        left = {tp for tp in tps if ends[tp] > await consumer.position(tp)}
        while left:
            batch = await consumer.getmany(*left, timeout_ms=1000)
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset < ends[tp]:
                        yield rec
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()


async def read_messages(settings: KafkaSettings, spec: TopicSpec, model: type[M], *,
                        limit: int | None = None, idle_s: float = 5.0,
                        since: datetime | None = None) -> AsyncIterator[M]:
    """Messages appended at or after ``since`` (else all), until ``limit`` or ``idle_s`` of quiet.

    Unreadable records are logged and skipped (the consumers dead-letter them).
    """
    from aiokafka import AIOKafkaConsumer

    name = f"{settings.topic_namespace}{spec.name}"
    consumer = AIOKafkaConsumer(name, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    seen = 0
    try:
        tps = sorted(consumer.assignment())
        if not tps:
            return
        if since is not None:
            # End offsets first: a record appended after this read is at or past them, so it is
            # never skipped when no record at or after ``since`` exists yet.
            ends = await consumer.end_offsets(tps)
            found = await consumer.offsets_for_times({tp: int(since.timestamp() * 1000) for tp in tps})
            for tp in tps:
                consumer.seek(tp, ends[tp] if found.get(tp) is None else found[tp].offset)
        while limit is None or seen < limit:
            batch = await consumer.getmany(timeout_ms=int(idle_s * 1000))
            if not batch:
                return
            for records in batch.values():
                for rec in records:
                    try:
                        message = decode(model, rec.value)
                    except SchemaError as exc:
                        log.warning("%s@%d: unreadable: %s", name, rec.offset, exc)
                        continue
                    yield message
                    seen += 1
                    if limit is not None and seen >= limit:
                        return
    finally:
        await consumer.stop()

