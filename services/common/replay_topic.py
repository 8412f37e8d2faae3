"""Read a topic from the beginning up to its current end (no consumer group): state rebuilds."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.settings import KafkaSettings


async def read_to_end(settings: KafkaSettings, name: str) -> AsyncIterator[bytes]:
    """Every record value of topic ``name`` that exists now, partition by partition."""
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
                        yield rec.value
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
