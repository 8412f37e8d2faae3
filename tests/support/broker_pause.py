"""Pausing the real Kafka broker (SIGSTOP, then SIGCONT) for an outage test, whatever started it.

- the session's local stack (``devstack``): the broker's pid is in ``<state dir>/kafka.pid``;
- a broker at ``KAFKA_BOOTSTRAP_SERVERS`` on this machine: the process listening on its port, found
  through ``/proc/net/tcp*`` and the processes' socket fds;
- a testcontainers container: ``docker pause`` / ``unpause`` (the cgroup freezer, the same stop).

:func:`paused` always resumes the broker on the way out (a failing test must not leave the session's
shared broker stopped for the tests after it).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` on this machine, if this user can see it."""
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not wanted:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(proc.name)
        except OSError:
            continue
    return None


def broker_pauser(services: Any, bootstrap: str) -> tuple[Callable[[], None], Callable[[], None], str]:
    """``(pause, resume, how)`` for the session's broker at ``bootstrap``; raises LookupError if none."""
    containers = getattr(services, "_containers", None) or []
    kafka_containers = [c for c in containers if "kafka" in str(getattr(c, "image", "")).lower()]
    if kafka_containers:
        wrapped = kafka_containers[0].get_wrapped_container()
        return wrapped.pause, wrapped.unpause, "docker pause"
    state_dir = getattr(services, "_state_dir", None)
    pid = None
    if state_dir is not None and (Path(state_dir) / "kafka.pid").exists():
        pid = int((Path(state_dir) / "kafka.pid").read_text().strip())
    if pid is None:
        pid = pid_listening_on(int(bootstrap.rsplit(":", 1)[1]))
    if pid is None:
        raise LookupError(f"cannot find the process of the Kafka broker at {bootstrap} to pause it "
                          "(not the session's local stack, no visible listener on its port)")
    return (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT)), f"SIGSTOP pid {pid}"


@contextmanager
def paused(pause: Callable[[], None], resume: Callable[[], None]) -> Iterator[None]:
    """The broker stopped for the block; resumed however the block ends."""
    pause()
    try:
        yield
    finally:
        resume()
