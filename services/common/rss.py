"""Resident memory of a process and of its descendants, from Linux ``/proc`` (no psutil needed).

Why here: the demo's memory watch, the per-service benchmark and the routed-load benchmark read the
same figures the same way. RSS summed over a tree counts pages shared between processes (libraries,
a forked parent's pages) once per process, so a tree's figure is an upper bound.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
MIB = 2**20


def _status_kb(pid: int, field: str) -> float:
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    raise KeyError(field)


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of ``pid`` (default: this process) in MiB; 0.0 once the process is gone."""
    try:
        return _status_kb(pid or os.getpid(), "VmRSS") / 1024
    except (OSError, KeyError):
        return 0.0


def hwm_mb(pid: int | None = None) -> float | None:
    """Peak resident memory of ``pid`` (Linux ``VmHWM``) in MiB, if known."""
    try:
        return _status_kb(pid or os.getpid(), "VmHWM") / 1024
    except (OSError, KeyError):
        return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's ``children`` file; empty once it is gone)."""
    out: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, breadth first."""
    found, frontier = [], children(pid)
    while frontier:
        found.extend(frontier)
        frontier = [c for p in frontier for c in children(p)]
    return found


def tree_rss_mb(pid: int | None = None) -> tuple[float, dict[int, float]]:
    """RSS of ``pid`` plus every descendant, in MiB, and each descendant's own figure."""
    pid = pid or os.getpid()
    kids = {c: rss_mb(c) for c in descendants(pid)}
    return rss_mb(pid) + sum(kids.values()), kids


def command_name(pid: int) -> str:
    """The process's command line, shortened (``?`` once it is gone)."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    return " ".join(words)[:80] or "?"


def give_back() -> None:
    """Collect garbage, then hand freed heap pages back to the kernel (glibc ``malloc_trim``; a no-op
    elsewhere). Why: a long process that freed a model keeps its arenas resident until trimmed."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return
