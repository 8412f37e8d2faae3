"""``up``, ``down`` and ``status`` of the components that run from one state dir."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devstack.base import (
    COMPONENTS,
    DEFAULT_STATE_DIR,
    KAFKA_READY_TIMEOUT_S,
    REDIS_READY_TIMEOUT_S,
    StackInfo,
    _locked,
    _say,
)
from devstack.jars import prepare
from devstack.kafka import _start_kafka, wait_kafka_ready
from devstack.procs import _pid_alive, _port_open, _read_pid, _stop_process
from devstack.redis import _start_redis, wait_redis_ready
from devstack.state import _info_from_state, _read_state, _write_state

# What a process's command line must contain for a pid file to still be "ours".
_DEFAULT_MARKERS = {"kafka": "kafka.Kafka", "redis": "redis-server"}


def _running(state_dir: Path, name: str, entry: dict[str, Any]) -> bool:
    pid = _read_pid(state_dir / f"{name}.pid")
    return pid is not None and pid == entry.get("pid") and _pid_alive(pid, entry.get("marker"))


def up(state_dir: Path | str = DEFAULT_STATE_DIR, kafka_port: int | None = None,
       redis_port: int | None = None, *, libs_dir: Path | str | None = None,
       components: Sequence[str] = COMPONENTS,
       kafka_timeout_s: float = KAFKA_READY_TIMEOUT_S) -> StackInfo:
    """Start (or find running) the components in ``state_dir`` and return their endpoints.

    Ports: the given one, else the one used last time, else 9092/6379, else any free one;
    ``0`` means any free port. ``libs_dir`` shares one jar cache between state dirs.
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown stack components {sorted(unknown)}; known: {COMPONENTS}")
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state_dir / ".lock"):
        state = _read_state(state_dir)
        taken: set[int] = set()
        for name in COMPONENTS:
            entry = state.get(name) or {}
            if _running(state_dir, name, entry):
                taken.update(p for p in (entry.get("port"), entry.get("controller_port")) if p)

        if "kafka" in components:
            entry = state.get("kafka") or {}
            if _running(state_dir, "kafka", entry):
                _say(f"kafka already running at {entry['bootstrap_servers']} (pid {entry['pid']})")
                wait_kafka_ready(entry["bootstrap_servers"], 30.0,
                                 alive=lambda: _pid_alive(entry["pid"], entry.get("marker")),
                                 logs=(Path(entry.get("log", state_dir / "kafka" / "broker.log")),))
            else:
                (state_dir / "kafka.pid").unlink(missing_ok=True)
                libs = prepare(state_dir, libs_dir=libs_dir)
                entry = _start_kafka(state_dir, kafka_port, libs, entry, taken, kafka_timeout_s)
                taken.update((entry["port"], entry["controller_port"]))
                state["kafka"] = entry
                _write_state(state_dir, state)

        if "redis" in components:
            entry = state.get("redis") or {}
            if _running(state_dir, "redis", entry):
                _say(f"redis already running at {entry['url']} (pid {entry['pid']})")
                wait_redis_ready(entry["url"], 5.0)
            else:
                (state_dir / "redis.pid").unlink(missing_ok=True)
                state["redis"] = _start_redis(state_dir, redis_port, entry, taken, REDIS_READY_TIMEOUT_S)
                _write_state(state_dir, state)

        info = _info_from_state(state)
        return StackInfo(bootstrap_servers=info.bootstrap_servers if "kafka" in components else None,
                         redis_url=info.redis_url if "redis" in components else None)


def down(state_dir: Path | str = DEFAULT_STATE_DIR, *, wipe: bool = False) -> None:
    """Stop whatever runs from ``state_dir`` (SIGTERM, then SIGKILL after a deadline).

    ``wipe`` also deletes the broker data (the jar cache is kept).
    """
    state_dir = Path(state_dir).resolve()
    if not state_dir.exists():
        return
    with _locked(state_dir / ".lock"):
        state = _read_state(state_dir)
        for name in ("redis", "kafka"):
            entry = state.get(name) or {}
            pidfile = state_dir / f"{name}.pid"
            pid = _read_pid(pidfile) or entry.get("pid")
            if pid:
                _stop_process(pid, name, entry.get("marker") or _DEFAULT_MARKERS[name])
            elif entry:
                _say(f"{name} was not running")
            pidfile.unlink(missing_ok=True)
            if entry:
                entry.pop("pid", None)
                entry["stopped_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if state:
            _write_state(state_dir, state)  # keep the ports so the next `up` reuses them
        if wipe:
            shutil.rmtree(state_dir / "kafka" / "data", ignore_errors=True)
            _say("wiped the broker data")


def status(state_dir: Path | str = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """What runs from ``state_dir``: per component ``running``, endpoint and pid."""
    state_dir = Path(state_dir).resolve()
    state = _read_state(state_dir)
    out: dict[str, Any] = {"state_dir": str(state_dir)}
    for name in COMPONENTS:
        entry = state.get(name) or {}
        running = _running(state_dir, name, entry)
        endpoint = entry.get("bootstrap_servers") if name == "kafka" else entry.get("url")
        out[name] = {"running": running, "endpoint": endpoint,
                     "answering": bool(running and entry.get("port") and _port_open(entry["port"])),
                     "pid": entry.get("pid") if running else None, "log": entry.get("log")}
    return out
