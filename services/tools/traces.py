"""``fanroute traces``: read traces back from the Kafka topic and print one line each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime

from schemas import Trace, decode, topic
from services.common.errors import SchemaError
from services.common.settings import KafkaSettings


async def read_traces(settings: KafkaSettings, *, limit: int | None = None, idle_s: float = 5.0,
                      since: datetime | None = None) -> AsyncIterator[Trace]:
    """Yield traces (appended at or after ``since``, else all) until ``limit`` or ``idle_s`` of quiet.

    Reads without a consumer group, so it never moves any service's committed offsets.
    """
    from aiokafka import AIOKafkaConsumer

    name = f"{settings.topic_namespace}{topic('traces').name}"
    # Subscribing without a group assigns every partition of the topic once metadata is in.
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
                        yield decode(Trace, rec.value)
                    except SchemaError as exc:
                        print(f"  (offset {rec.offset}: unreadable trace: {exc})")
                        continue
                    seen += 1
                    if limit is not None and seen >= limit:
                        return
    finally:
        await consumer.stop()


def format_trace(t: Trace) -> str:
    """One line: id, query, each provider's status/citations/latency, overlap and contested flag."""
    cands = " ".join(
        f"{c.provider}:{len(c.citations)}@{c.latency_ms:.0f}ms" if c.ok else f"{c.provider}:{c.error_kind}"
        for c in t.candidates)
    flag = "CONTESTED" if t.signals.contested else "agreed"
    q = t.query if len(t.query) <= 48 else t.query[:45] + "..."
    return (f"{t.trace_id[:12]} {t.query_id or '-':<14} {q!r:<50} {cands} "
            f"overlap={t.signals.mean_overlap:.2f} {flag}")


async def tail(settings: KafkaSettings, limit: int | None, idle_s: float) -> int:
    """Print traces as they arrive; returns how many were printed."""
    n = 0
    async for t in read_traces(settings, limit=limit, idle_s=idle_s):
        print(format_trace(t), flush=True)
        n += 1
    return n


def run_tail(settings: KafkaSettings, limit: int | None, idle_s: float) -> int:
    return asyncio.run(tail(settings, limit, idle_s))
