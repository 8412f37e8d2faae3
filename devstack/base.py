"""Where the stack lives and what it answers with: paths, ports, timeouts, ``StackError``,
``StackInfo``, and the small helpers every part uses (progress lines, the lock, log tails)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from services.common.errors import FanrouteError

REPO_ROOT = Path(__file__).resolve().parents[1]
POM = REPO_ROOT / "scripts" / "kafka" / "pom.xml"
DEFAULT_STATE_DIR = REPO_ROOT / ".stack"

DEFAULT_KAFKA_PORT = 9092
DEFAULT_REDIS_PORT = 6379
COMPONENTS = ("kafka", "redis")

KAFKA_READY_TIMEOUT_S = 120.0
REDIS_READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 30.0
FORMAT_TIMEOUT_S = 120.0
MAVEN_TIMEOUT_S = 900.0
LOG_TAIL_LINES = 40


class StackError(FanrouteError, RuntimeError):
    """The local stack could not be prepared, started, or stopped."""


@dataclasses.dataclass(frozen=True)
class StackInfo:
    """Where the stack answers. A component that was not asked for is ``None``."""

    bootstrap_servers: str | None
    redis_url: str | None

    def env(self) -> dict[str, str]:
        """Environment variables that point clients and fanroute services at this stack."""
        out: dict[str, str] = {}
        if self.bootstrap_servers:
            out["KAFKA_BOOTSTRAP_SERVERS"] = self.bootstrap_servers
            out["FANROUTE_KAFKA__BOOTSTRAP_SERVERS"] = self.bootstrap_servers
        if self.redis_url:
            out["REDIS_URL"] = self.redis_url
            out["FANROUTE_REDIS__URL"] = self.redis_url
        return out


def _say(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (two ``up`` at once in one state dir serialise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return f"(no {path.name})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path.name} is empty)"
