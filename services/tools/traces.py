"""``fanroute traces``: read traces back from the Kafka topic and print one line each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime

from schemas import Trace, topic
from services.common.replay_topic import read_messages
from services.common.settings import KafkaSettings


async def read_traces(settings: KafkaSettings, *, limit: int | None = None, idle_s: float = 5.0,
                      since: datetime | None = None) -> AsyncIterator[Trace]:
    """Traces appended at or after ``since`` (else all), until ``limit`` or ``idle_s`` of quiet."""
    async for t in read_messages(settings, topic("traces"), Trace, limit=limit, idle_s=idle_s,
                                 since=since):
        yield t


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
