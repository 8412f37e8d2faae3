"""Scores from a telemetry JSONL, joined to imported episodes by trace id as reward components.

Each line is ``{"trace_id", "scores": {name: number}}`` or ``{"trace_id", "name", "value"}``; one
trace may span many lines. The same score given twice for a trace with two values is a bad line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.base import content_id
from schemas.episode import RewardComponent
from services.importer.formats import LineError, jsonl_records

EXPECTED = 'telemetry JSONL: {"trace_id", "scores": {name: number}} or {"trace_id", "name", "value"} per line'


@dataclass(frozen=True)
class Telemetry:
    """Scores by trace id and name, where they came from, and the lines that could not be read."""

    source: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[LineError] = field(default_factory=list)

    def rewards(self, episode_id: str, trace_id: str | None) -> tuple[RewardComponent, ...]:
        """The reward components of ``trace_id``'s scores for ``episode_id``, by name."""
        scores = self.scores.get(trace_id, {}) if trace_id else {}
        return tuple(RewardComponent(component_id=content_id(episode_id, name), name=name, value=value,
                                     source=self.source) for name, value in sorted(scores.items()))

    def unmatched(self, trace_ids: Iterable[str | None]) -> list[str]:
        """Telemetry trace ids that none of ``trace_ids`` is, sorted."""
        return sorted(set(self.scores) - set(trace_ids))


def read_telemetry(path: Path) -> Telemetry:
    """The scores of a telemetry JSONL; unreadable lines are kept as errors, not raised."""
    telemetry = Telemetry(source=f"telemetry:{path.name}")
    first_seen: dict[tuple[str, str], int] = {}
    for rec in jsonl_records(path, EXPECTED):
        if isinstance(rec, LineError):
            telemetry.errors.append(rec)
            continue
        try:
            _merge(telemetry, first_seen, *_line_scores(rec.data), rec.line)
        except ValueError as exc:
            telemetry.errors.append(LineError(str(path), rec.line, str(exc), EXPECTED))
    return telemetry


def _line_scores(data: Any) -> tuple[str, dict[str, float]]:
    """(trace id, {name: value}) of one line, or ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    trace_id = data.get("trace_id")
    if not isinstance(trace_id, str) or not trace_id:
        raise ValueError('no "trace_id" string')
    if "scores" in data:
        raw = data["scores"]
        if not isinstance(raw, dict):
            raise ValueError('"scores" must be an object of name: number')
    elif "name" in data and "value" in data:
        raw = {data["name"]: data["value"]}
    else:
        raise ValueError('neither "scores" nor "name" and "value"')
    return trace_id, {_name(n): _number(n, v) for n, v in raw.items()}


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"score name {name!r} is not a non-empty string")
    return name


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"score {name!r} is {value!r}, not a finite number")
    return float(value)


def _merge(telemetry: Telemetry, first_seen: dict[tuple[str, str], int], trace_id: str,
           scores: dict[str, float], line: int) -> None:
    """Add one line's scores, all or none: a score already given with another value is an error."""
    known = telemetry.scores.get(trace_id, {})
    for name, value in scores.items():
        if name in known and known[name] != value:
            raise ValueError(f"score {name!r} of trace {trace_id} was {known[name]} on line "
                             f"{first_seen[trace_id, name]}, now {value}")
    for name, value in scores.items():
        telemetry.scores.setdefault(trace_id, {}).setdefault(name, value)
        first_seen.setdefault((trace_id, name), line)
