"""redis-server (the Debian binary) on loopback, and the PING readiness wait."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from devstack.base import (
    DEFAULT_REDIS_PORT,
    REDIS_READY_TIMEOUT_S,
    StackError,
    _say,
    _tail,
)
from devstack.procs import _choose_port, _ready_or_stopped


def _redis_ping(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_redis_ready(url: str, timeout_s: float = REDIS_READY_TIMEOUT_S, *,
                     alive: Callable[[], bool] | None = None, logs: Sequence[Path] = ()) -> float:
    """Block until PING at ``url`` answers; returns the seconds waited."""
    started = time.monotonic()
    while not _redis_ping(url):
        if alive is not None and not alive():
            why = "exited during start-up"
        elif time.monotonic() - started > timeout_s:
            why = f"did not answer PING within {timeout_s:g} s"
        else:
            time.sleep(0.1)
            continue
        tails = "".join(f"\n--- tail of {p} ---\n{_tail(p)}" for p in logs)
        raise StackError(f"redis at {url} {why}{tails}")
    return time.monotonic() - started


def _start_redis(state_dir: Path, port_req: int | None, prev: dict[str, Any], taken: set[int],
                 timeout_s: float) -> dict[str, Any]:
    server = shutil.which("redis-server")
    if server is None:
        raise StackError("redis-server is not installed. Install it with "
                         "`apt-get install -y redis-server` (scripts/bootstrap.sh does this).")
    rdir = state_dir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    log, out_log = rdir / "redis.log", rdir / "redis.out"
    port = _choose_port(port_req, prev.get("port"), DEFAULT_REDIS_PORT, taken)
    _say(f"starting redis-server on 127.0.0.1:{port}")
    with open(out_log, "ab") as out:
        proc = subprocess.Popen(
            [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--protected-mode", "yes", "--dir", str(rdir), "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=rdir,
            start_new_session=True)
    (state_dir / "redis.pid").write_text(f"{proc.pid}\n")
    url = f"redis://127.0.0.1:{port}/0"
    marker = "redis-server"
    waited = _ready_or_stopped(proc, "redis", state_dir, 5.0, lambda alive: wait_redis_ready(
        url, timeout_s, alive=alive, logs=(log, out_log)))
    _say(f"redis ready at {url} in {waited:.1f} s")
    return {"pid": proc.pid, "port": port, "url": url, "marker": marker, "log": str(log),
            "ready_s": round(waited, 2)}
