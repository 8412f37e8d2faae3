"""``fanroute import``: conversation logs (OpenAI, Anthropic, LangSmith, Vercel, CSV) → episodes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from itertools import islice
from pathlib import Path

from services.common.errors import FanrouteError
from services.importer.formats import FORMATS
from services.importer.redact import PRESETS, Redactor
from services.importer.run import ImportResult, import_file, write_episodes
from services.importer.telemetry import read_telemetry

_SHOWN = 20  # bad lines / skips / unmatched ids listed in full before "... and N more"


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
