"""The demo's numbered steps, its log file, and the one line a failed step prints.

Why: a newcomer whose demo fails must read which step failed, why, and where the full story is —
not a 200-line traceback from uvicorn's lifespan. Every log record (tracebacks included) goes to the
run's log file; the terminal keeps the demo's own progress lines and one-line warnings.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class _Current:
    number: int = 0
    total: int = 0
    title: str = "starting"


_current = _Current()


def step(number: int, total: int, text: str) -> None:
    """Print ``[number/total] text`` and remember it as the step now running."""
    _current.number, _current.total = number, total
    _current.title = text.split("\n", 1)[0].split(" (", 1)[0].rstrip(" .:;")[:90]
    print(f"[{number}/{total}] {text}", flush=True)


def current() -> str:
    """``[k/N] title`` of the step now running."""
    return f"[{_current.number}/{_current.total}] {_current.title}" if _current.total else _current.title


def reset() -> None:
    """Forget the previous run's step (a process may run the demo twice, as the tests do)."""
    _current.number, _current.total, _current.title = 0, 0, "starting"


class OneLine(logging.Formatter):
    """A log line without its traceback (that goes to the log file)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None}))
        return text.split("\n", 1)[0]


def _ours(record: logging.LogRecord) -> bool:
    """The terminal shows the project's own warnings; libraries' (aiokafka, uvicorn) stay in the log file."""
    return record.name.split(".", 1)[0] in ("services", "devstack", "schemas")


def _formatter(cls: type[logging.Formatter] = logging.Formatter) -> logging.Formatter:
    fmt = cls("%(asctime)sZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
    fmt.converter = time.gmtime
    return fmt


@contextlib.contextmanager
def logged_to(log_file: Path) -> Iterator[Path]:
    """For the block: every record at INFO and up goes to ``log_file`` with its traceback; the terminal
    shows warnings and errors as one line each."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(_formatter())
    consoles = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]
    saved = [(h, h.formatter, h.level) for h in consoles]
    level = root.level
    for h in consoles:
        h.setFormatter(_formatter(OneLine))
        h.setLevel(max(h.level, logging.WARNING))
        h.addFilter(_ours)
    root.addHandler(file_handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield log_file
    finally:
        for h in consoles:
            h.removeFilter(_ours)
        root.removeHandler(file_handler)
        file_handler.close()
        root.setLevel(level)
        for h, fmt, lvl in saved:
            h.setFormatter(fmt)
            h.setLevel(lvl)


def failure_line(exc: BaseException, log_file: Path) -> str:
    """``demo failed at [k/N] <step>: <Type>: <why> (full log: <file>)``; the traceback goes to the file."""
    with log_file.open("a", encoding="utf-8") as f:
        f.write(f"\n--- demo failed at {current()} ---\n")
        f.write("".join(traceback.format_exception(exc)))
    why = str(exc).strip().split("\n", 1)[0] or "(no message)"
    return f"fanroute demo: failed at {current()}: {type(exc).__name__}: {why[:300]} (full log: {log_file})"
