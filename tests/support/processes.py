"""A service (or any Python script) in its own process for a block of a test, then crashed or stopped:
what the kill -9 and restart tests run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from services.common.settings import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]


def service_env(kafka: KafkaSettings, redis_url: str, **extra: str) -> dict[str, str]:
    """The ``FANROUTE_*`` variables that point a service at this test's broker namespace and Redis."""
    return {"FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "FANROUTE_KAFKA__TOPIC_NAMESPACE": kafka.topic_namespace, "FANROUTE_REDIS__URL": redis_url,
            "FANROUTE_LOG_LEVEL": "WARNING", **extra}


@contextmanager
def running(*args: str, env: Mapping[str, str] | None = None, crash: bool = False) -> Iterator[subprocess.Popen]:
    """``python *args`` from the repository root (this environment plus ``env``) for the block; at its end
    the process is killed with SIGKILL (``crash=True``: a crash mid-stream) or terminated."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        yield proc
    finally:
        if crash:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        else:
            proc.terminate()
            proc.wait(timeout=20)
