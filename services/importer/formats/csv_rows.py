"""CSV exports: one exchange per row under a header naming its columns."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

from services.common.errors import ConfigError
from services.importer.formats.base import Conversation, Format, Item, LineError, Role, checked
from services.importer.formats.records import read_text

_CSV_EXPECTED = "CSV with a header naming user,assistant (or query,response), optional system and trace_id"
_CSV_PAIRS = (("user", "assistant"), ("query", "response"))
_CSV_ROLES: tuple[Role, ...] = ("system", "user", "assistant")


def _read_csv(path: Path) -> Iterator[Item]:
    """Rows of a CSV with a header: system (optional), user, assistant, trace_id (optional)."""
    rows = csv.reader(io.StringIO(read_text(path), newline=""))
    header = [h.strip().lower() for h in next(rows, [])]
    pair = next(((u, a) for u, a in _CSV_PAIRS if u in header and a in header), None)
    if pair is None:
        raise ConfigError(f"{path}:1: header {header} names neither user,assistant nor query,response; "
                          f"expected {_CSV_EXPECTED}")
    used = {"system", "trace_id", *pair}
    while True:
        line = rows.line_num + 1
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as exc:
            yield LineError(str(path), line, f"unreadable CSV row ({exc})", _CSV_EXPECTED)
            continue
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            yield LineError(str(path), line, f"{len(row)} fields, the header has {len(header)}", _CSV_EXPECTED)
            continue
        cells = dict(zip(header, row, strict=True))
        turns = [(role, cells.get(col, "")) for role, col in zip(_CSV_ROLES, ("system", *pair), strict=True)]
        yield checked(Conversation(cells.get("trace_id") or None, [t for t in turns if t[1].strip()],
                                    {k: v for k, v in cells.items() if k not in used and v}, line=line))


CSV = Format("csv", _CSV_EXPECTED, _read_csv)
