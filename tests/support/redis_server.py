"""A redis-server of a test's own, on a fixed port, that the test can stop and start again.

Configured like compose's Redis (append-only file, in ``data_dir``), so what was written before a
restart is there after it. The session's Redis (``redis_url``) is shared by every test; a fault
test restarts only its own.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Self

from devstack.redis import wait_redis_ready
from tests.support.serving import free_port


class RedisServer:
    """``with RedisServer(dir) as r:`` … ``r.stop()`` … ``r.start()``: the same port and data each time."""

    def __init__(self, data_dir: Path, *, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.appendonly = appendonly
        self.starts = 0
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server is not installed (scripts/bootstrap.sh installs it)"
        self._proc = subprocess.Popen(
            [server, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.data_dir),
             "--logfile", str(self.data_dir / "redis.log"), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_redis_ready(self.url, timeout_s, alive=lambda: self._proc is not None and self._proc.poll() is None,
                         logs=(self.data_dir / "redis.log",))
        self.starts += 1

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Stop it (SIGTERM: a clean shutdown that flushes the append-only file; SIGKILL: a crash)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)
            self._proc.wait(timeout=timeout_s)
        self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGKILL)
