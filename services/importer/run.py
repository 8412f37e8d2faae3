"""``fanroute import FILE --format ... --out episodes.jsonl``: exports -> redacted episodes + rewards.

Nothing is written unless the whole input reads cleanly, or ``--skip-bad`` says to drop bad lines.
Episode ids are content-derived (format + trace id, else the redacted conversation), so importing
the same file twice gives the same ids and the same bytes. A record without a timestamp gets
:data:`UNKNOWN_TIME` as ``created_at`` (a clock reading would break that).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from schemas.base import content_id
from schemas.episode import ChatMessage, Episode, RewardComponent
from services.common.errors import ConfigError
from services.importer.formats import (
    FORMATS,
    Conversation,
    LineError,
    Skipped,
    Turn,
    detect_format,
)
from services.importer.redact import Redactor, redact_conversation
from services.importer.telemetry import Telemetry

UNKNOWN_TIME = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class ImportResult:
    """What one import produced: the episodes, the bad lines, and the numbers for the summary."""

    episodes: list[Episode]
    errors: list[LineError]
    format: str = ""
    conversations: int = 0  # well-formed records, whether or not they became episodes
    skipped: list[Skipped] = field(default_factory=list)
    redactions: Counter[str] = field(default_factory=Counter)
    rewards_joined: int = 0
    unmatched_telemetry: list[str] = field(default_factory=list)


def import_file(path: Path | str, fmt: str, *, redactor: Redactor, telemetry: Telemetry | None = None,
                system_prompt: str | None = None, created_at: datetime = UNKNOWN_TIME) -> ImportResult:
    """Read ``path`` as ``fmt`` ("auto" sniffs), redact, join telemetry scores; raises ConfigError
    only for a file that cannot be read at all (bad lines are returned in ``errors``).

    ``system_prompt`` becomes the system turn of conversations that have none.
    """
    path = Path(path)
    name = detect_format(path) if fmt == "auto" else fmt
    if name not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)} or auto")
    result = ImportResult([], list(telemetry.errors) if telemetry else [], format=name)
    lines_by_id: dict[str, int] = {}
    trace_ids: list[str | None] = []
    for item in FORMATS[name].read(path):
        if isinstance(item, LineError):
            result.errors.append(item)
        elif isinstance(item, Skipped):
            result.conversations += 1
            result.skipped.append(item)
        else:
            result.conversations += 1
            counts: Counter[str] = Counter()
            clean = redact_conversation(item, redactor, counts)
            turns = _with_system(clean.messages, system_prompt)
            ep_id = content_id("import", name, clean.trace_id or [list(t) for t in turns])
            if ep_id in lines_by_id:
                result.skipped.append(Skipped(item.line, f"same episode as line {lines_by_id[ep_id]}"))
                continue
            lines_by_id[ep_id] = item.line
            rewards = telemetry.rewards(ep_id, item.trace_id) if telemetry else ()
            result.episodes.append(_episode(ep_id, clean, turns, rewards, created_at))
            result.redactions.update(counts)
            result.rewards_joined += len(rewards)
            trace_ids.append(item.trace_id)
    result.unmatched_telemetry = telemetry.unmatched(trace_ids) if telemetry else []
    return result


def _with_system(turns: list[Turn], system_prompt: str | None) -> list[Turn]:
    if system_prompt and not any(role == "system" for role, _ in turns):
        return [("system", system_prompt), *turns]
    return turns


def _episode(ep_id: str, conv: Conversation, turns: list[Turn], rewards: tuple[RewardComponent, ...],
             fallback: datetime) -> Episode:
    return Episode(episode_id=ep_id, trace_id=conv.trace_id, created_at=conv.created_at or fallback,
                   messages=tuple(ChatMessage(role=role, content=text) for role, text in turns),
                   rewards=rewards)


def write_episodes(episodes: list[Episode], out: Path) -> None:
    """One canonical JSON episode per line, replacing ``out`` whole (never a half-written file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(b"".join(ep.to_bytes() + b"\n" for ep in episodes))
    tmp.replace(out)
