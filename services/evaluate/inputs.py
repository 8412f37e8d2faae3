"""Eval inputs: traces (a JSONL file or the ``traces`` topic between two times) and the held-out split."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from schemas.base import decode
from schemas.episode import Episode
from schemas.topics import topic
from schemas.trace import Trace
from services.common.errors import FanrouteError, SchemaError
from services.common.prompt import query_of
from services.common.settings import KafkaSettings
from services.common.splits import normalise_query


class EvalInputError(FanrouteError, ValueError):
    """An eval or promote input is unusable (bad file line, unknown adapter, mismatched eval.json)."""


def load_traces_file(path: Path) -> list[Trace]:
    """Traces from JSONL, one per line; a bad line is an :class:`EvalInputError` naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise EvalInputError(f"traces file {path} does not exist")
    out = []
    with path.open("rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(decode(Trace, line))
            except SchemaError as exc:
                raise EvalInputError(f"{path}:{n}: not a trace: {exc}") from exc
    return out


async def topic_traces(kafka: KafkaSettings, since: datetime | None = None,
                       until: datetime | None = None) -> tuple[list[Trace], int]:
    """(traces, unreadable): the ``traces`` topic as it is now, records appended in [since, until)."""
    from services.common.replay_topic import read_topic

    bad = 0

    def unreadable(record, exc) -> None:
        nonlocal bad
        bad += 1  # the consumers dead-letter these

    out = [t async for t in read_topic(kafka, topic("traces"), model=Trace, since=since, until=until,
                                       on_unreadable=unreadable)]
    return out, bad


@dataclass
class HeldOut:
    """The fan-out traces the student never trained on, and how many of the rest each rule excluded."""

    traces: list[Trace]
    read: int
    excluded: dict[str, int] = field(default_factory=dict)


def held_out(traces: Iterable[Trace], episodes: Sequence[Episode], *, require: str | None = None) -> HeldOut:
    """Fan-out traces whose normalised query is no training episode's user turn (one per trace id), in the
    order of their queries (then ids), not of their arrival: the paired bootstrap resamples by position,
    so the same outcomes must come in the same order for the same interval.

    ``require`` drops traces that lack that provider (the best single one), counted.
    """
    trained = {normalise_query(query_of(ep)) for ep in episodes}
    excluded = {"not_fanout": 0, "duplicate_trace_id": 0, "trained_query": 0, "missing_best_single": 0}
    seen: set[str] = set()
    kept, read = [], 0
    for t in traces:
        read += 1
        if t.mode != "fanout":
            excluded["not_fanout"] += 1
        elif t.trace_id in seen:
            excluded["duplicate_trace_id"] += 1
        elif normalise_query(t.query) in trained:
            excluded["trained_query"] += 1
        elif require is not None and all(c.provider != require for c in t.candidates):
            excluded["missing_best_single"] += 1
        else:
            kept.append(t)
        seen.add(t.trace_id)
    kept.sort(key=lambda t: (t.query_id or "", t.query, t.trace_id))
    return HeldOut(kept, read, excluded)
