"""Small filesystem and parsing helpers shared by services."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; on success it replaces ``target``, else it is removed.

    A reader never sees a half-written directory, and a killed writer leaves only a dot-prefixed
    temporary next to it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def instant(text: str) -> datetime:
    """An ISO-8601 instant from the command line; a naive one is read as UTC."""
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {text!r} (e.g. 2026-09-01T00:00:00Z)")
    return t if t.tzinfo else t.replace(tzinfo=UTC)
