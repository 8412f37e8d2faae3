"""``fanroute import FILE --format ... --out episodes.jsonl``: exports -> redacted episodes + rewards.

Nothing is written unless the whole input reads cleanly, or ``--skip-bad`` says to drop bad lines.
Episode ids are content-derived (format + trace id, else the redacted conversation), so importing
the same file twice gives the same ids and the same bytes. A record without a timestamp gets
:data:`UNKNOWN_TIME` as ``created_at`` (a clock reading would break that).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path

from schemas.base import content_id
from schemas.episode import ChatMessage, Episode, RewardComponent
from services.common.errors import ConfigError, FanrouteError
from services.importer.formats import (
    FORMATS,
    Conversation,
    LineError,
    Skipped,
    Turn,
    detect_format,
)
from services.importer.redact import PRESETS, Redactor, redact_conversation
from services.importer.telemetry import Telemetry, read_telemetry

UNKNOWN_TIME = datetime(1970, 1, 1, tzinfo=UTC)
_SHOWN = 20  # bad lines / skips / unmatched ids listed in full before "... and N more"


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


def render_summary(result: ImportResult, path: Path, out: Path, redactor: Redactor) -> str:
    """The human summary printed after a successful import."""
    kinds = ", ".join(f"{k} {result.redactions[k]}" for k in redactor.kinds) or "none configured"
    lines = [f"fanroute import: {path} (format {result.format})",
             f"  conversations read    {result.conversations}",
             f"  episodes written      {len(result.episodes)} -> {out}",
             f"  skipped               {len(result.skipped)}",
             *_listed((f"line {s.line}: {s.reason}" for s in result.skipped), len(result.skipped)),
             f"  bad lines dropped     {len(result.errors)}",
             *_listed(map(str, result.errors), len(result.errors)),
             f"  redactions            {kinds}",
             f"  rewards joined        {result.rewards_joined}",
             f"  telemetry ids unmatched {len(result.unmatched_telemetry)}",
             *_listed(map(redactor.redact, result.unmatched_telemetry), len(result.unmatched_telemetry))]
    return "\n".join(lines)


def _listed(texts: Iterable[str], total: int) -> list[str]:
    """At most ``_SHOWN`` of ``texts``, indented, then how many more there were."""
    shown = [f"    {t}" for t in islice(texts, _SHOWN)]
    return shown + ([f"    ... and {total - _SHOWN} more"] if total > _SHOWN else [])


# --------------------------------------------------------------------------- CLI

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fanroute import`` on the top-level subparsers."""
    p = sub.add_parser("import", help="conversation logs (OpenAI, Anthropic, LangSmith, Vercel, CSV) -> episodes",
                       description=__doc__)
    p.add_argument("file", type=Path, help="the export to read")
    p.add_argument("--format", default="auto", choices=[*FORMATS, "auto"],
                   help="export format (default: sniff by extension and first record)")
    p.add_argument("--redact-preset", action="append", default=[], metavar="LIST",
                   help=f"comma-separated presets to redact: {','.join(PRESETS)} or all (default: none)")
    p.add_argument("--redact", action="append", default=[], metavar="NAME=REGEX",
                   help="also replace REGEX matches with [REDACTED:NAME] (repeatable)")
    p.add_argument("--telemetry", type=Path, default=None,
                   help='JSONL of {"trace_id", "scores": {...}} joined as reward components')
    p.add_argument("--system-prompt", default=None, help="system turn for conversations that have none")
    p.add_argument("--out", type=Path, required=True, help="episodes JSONL to write")
    p.add_argument("--skip-bad", action="store_true",
                   help="report and drop malformed lines instead of failing without writing")


def run(args: argparse.Namespace) -> int:
    """Run ``fanroute import``: 0 written, 2 bad input (nothing written)."""
    try:
        redactor = Redactor.build(args.redact_preset, args.redact)
        telemetry = read_telemetry(args.telemetry) if args.telemetry else None
        result = import_file(args.file, args.format, redactor=redactor, telemetry=telemetry,
                             system_prompt=args.system_prompt)
    except FanrouteError as exc:
        print(f"fanroute import: {exc}", file=sys.stderr)
        return 2
    if result.errors and not args.skip_bad:
        print("\n".join(_listed(map(str, result.errors), len(result.errors))), file=sys.stderr)
        print(f"fanroute import: {len(result.errors)} malformed line(s); nothing written "
              f"(fix them, or pass --skip-bad to import the rest)", file=sys.stderr)
        return 2
    try:
        write_episodes(result.episodes, args.out)
    except OSError as exc:
        print(f"fanroute import: cannot write {args.out} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(render_summary(result, args.file, args.out, redactor))
    return 0
