"""Ports and processes: pick a free port, tell whether a pid is still ours, stop a process
group (SIGTERM, then SIGKILL), and run a probe in a thread of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devstack.base import STOP_TIMEOUT_S, StackError, _say


def _port_free(port: int) -> bool:
    # SO_REUSEADDR like the JVM and redis do, so TIME_WAIT leftovers of our own last run
    # do not count as "taken"; a live listener still does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ephemeral ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _choose_port(requested: int | None, previous: int | None, default: int, taken: set[int]) -> int:
    """Explicit port > the one used last time > the conventional default > any free one.

    ``requested == 0`` means "any free port" (what tests use).
    """
    if requested:
        if not _port_free(requested):
            raise StackError(f"port {requested} on 127.0.0.1 is already in use")
        return requested
    if requested is None:
        for cand in (previous, default):
            if cand and cand not in taken and _port_free(cand):
                return cand
    while True:
        (port,) = _free_ports(1)
        if port not in taken:
            return port


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _pid_alive(pid: int | None, marker: str | None = None) -> bool:
    """Is ``pid`` a live (non-zombie) process, and, with ``marker``, is it still ours?"""
    if not pid:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        if done == pid:
            return False
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat[stat.rindex(")") + 2:].startswith("Z"):
                return False
            if marker is not None:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
                # Empty while a fresh child is still inside execve() (the new image's argv is
                # not mapped yet): it exists and cannot be told apart, so it counts as alive.
                return not cmdline.strip() or marker in cmdline
            return True
        except (OSError, ValueError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stop_process(pid: int, name: str, marker: str | None, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group, wait up to ``timeout``, then SIGKILL it."""
    if not _pid_alive(pid, marker):
        return
    _say(f"stopping {name} (pid {pid})")
    started = time.monotonic()
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)  # started with start_new_session=True: pgid == pid
        except ProcessLookupError:
            return
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _pid_alive(pid, marker):
                _say(f"{name} stopped in {time.monotonic() - started:.1f} s")
                return
            time.sleep(0.1)
        if sig == signal.SIGTERM:
            _say(f"{name} did not exit within {wait_s:.0f} s of SIGTERM; sending SIGKILL")
    raise StackError(f"{name} (pid {pid}) survived SIGKILL")


def _stop_child(proc: subprocess.Popen[bytes], name: str, timeout: float) -> None:
    """Stop a process this one started (its Popen is the reliable liveness source)."""
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    raise StackError(f"{name} (pid {proc.pid}) survived SIGKILL")


def _run_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread and return its result (keeps asyncio.run away from any
    event loop the caller, e.g. pytest-asyncio, owns in this thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="stack-probe", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _ready_or_stopped(proc: subprocess.Popen, name: str, state_dir: Path, stop_timeout_s: float,
                      wait: Callable[[Callable[[], bool]], float]) -> float:
    """Wait until a just-started child answers; if it never does, stop it and drop its pid file."""
    try:
        return wait(lambda: proc.poll() is None)
    except BaseException:
        _stop_child(proc, name, timeout=stop_timeout_s)
        (state_dir / f"{name}.pid").unlink(missing_ok=True)
        raise
