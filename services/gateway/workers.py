"""Several gateway processes on one port (``FANROUTE_WORKERS=N``): a supervisor and its workers.

Each worker is a whole gateway (``python -m services.gateway`` with ``FANROUTE_WORKER_INDEX``): its own
event loop, Kafka producer and spool directory (``<spool_dir>/worker-<i>``), listening on the same port
through ``SO_REUSEPORT`` so the kernel spreads connections over them. Every guarantee holds per worker (a
trace is acknowledged or spooled before its answer). What a worker that no longer exists left spooled — a
run with more workers, or a single-process run — is adopted at start by the worker it maps to (copied into
its own spool, fsynced, then acknowledged in the old one; a crash in between re-publishes a trace twice,
which consumers drop by its content-derived id). Metrics are collected across the workers with
prometheus_client's multiprocess mode, so ``/metrics`` on any of them answers for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from services.common.spool import SUFFIX, Spool, SpoolError
from services.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
SPOOL_NAME = "traces"
#: A worker that exits within this many seconds of its start is a start-up failure: the supervisor stops.
START_GRACE_S = 15.0
WORKER_PREFIX = "worker-"


def worker_spool_dir(base: Path, settings: GatewaySettings) -> Path:
    """The spool directory of this process: ``base`` alone, or ``base/worker-<i>`` for worker ``i``."""
    return base if settings.worker_index is None else base / f"{WORKER_PREFIX}{settings.worker_index}"


def orphan_spool_dirs(base: Path, settings: GatewaySettings) -> list[Path]:
    """Spool directories under ``base`` no live worker owns, that this process adopts.

    Worker ``i`` of ``N`` takes ``worker-<j>`` for every ``j >= N`` with ``j mod N == i``, and worker 0 the
    single-process spool in ``base`` itself; a single process takes every ``worker-<j>``."""
    n, i = (settings.workers, settings.worker_index) if settings.worker_index is not None else (1, 0)
    out = []
    if settings.worker_index is not None and i == 0 and (base / f"{SPOOL_NAME}{SUFFIX}").exists():
        out.append(base)
    with contextlib.suppress(OSError):
        for child in sorted(base.iterdir()):
            suffix = child.name.removeprefix(WORKER_PREFIX)
            if child.is_dir() and child.name.startswith(WORKER_PREFIX) and suffix.isdigit():
                j = int(suffix)
                if (settings.worker_index is None or j >= n) and j % n == i:
                    out.append(child)
    return out


def adopt(orphans: list[Path], own: Spool) -> int:
    """Move the pending records of each orphaned spool into ``own`` (open); returns how many moved.

    A spool still locked by a live process is left for a later start."""
    moved = 0
    for directory in orphans:
        old = Spool(directory, SPOOL_NAME, max_bytes=1 << 40, max_records=100_000_000)
        try:
            pending = old.open()
        except SpoolError as exc:
            log.warning("not adopting the spool in %s: %s", directory, exc)
            continue
        try:
            for rec in pending:
                own.append(rec.topic, rec.value, key=rec.key, headers=rec.headers, ts=rec.ts)
            old.ack([rec.seq for rec in pending])
            moved += len(pending)
        finally:
            old.close()
        if pending:
            log.warning("adopted %d spooled traces from %s (a worker that no longer runs)", len(pending), directory)
    return moved


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket with ``SO_REUSEPORT``: every worker binds its own, the kernel balances them."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("FANROUTE_WORKERS > 1 needs SO_REUSEPORT (Linux, BSD, macOS)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # Nagle's algorithm meets the client's delayed ACK (≈ 40 ms added to a response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


async def supervise(settings: GatewaySettings) -> int:
    """Run ``settings.workers`` worker processes until SIGTERM/SIGINT; restart one that dies after start.

    Returns the exit status: 0 after a clean stop, the worker's when one fails while starting."""
    if settings.port == 0:
        raise ValueError("FANROUTE_WORKERS > 1 needs a fixed FANROUTE_PORT (0 would give each worker its own)")
    reuseport_socket(settings.host, settings.port).close()  # fail here, once, when the port is taken
    metrics_dir = Path(tempfile.mkdtemp(prefix="fanroute-gateway-metrics-"))
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "FANROUTE_WORKERS": str(settings.workers)}
    procs: dict[int, tuple[asyncio.subprocess.Process, float]] = {}
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async def spawn(i: int) -> None:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.gateway",
                                                    env={**env, "FANROUTE_WORKER_INDEX": str(i)})
        procs[i] = (proc, time.monotonic())
        log.info("gateway worker %d started (pid %d)", i, proc.pid)

    status = 0
    try:
        for i in range(settings.workers):
            await spawn(i)
        log.info("%d gateway workers on %s:%d", settings.workers, settings.host, settings.port)
        while not stopping.is_set():
            waits = {asyncio.ensure_future(p.wait()): i for i, (p, _) in procs.items()}
            stop = asyncio.ensure_future(stopping.wait())
            done, _ = await asyncio.wait({stop, *waits}, return_when=asyncio.FIRST_COMPLETED)
            for fut in (stop, *waits):
                if fut not in done:
                    fut.cancel()
            for fut in done - {stop}:
                i = waits[fut]
                proc, started = procs[i]
                _mark_dead(proc.pid)
                if stopping.is_set():
                    break
                if time.monotonic() - started < START_GRACE_S:
                    log.error("gateway worker %d exited with %s while starting; stopping the others", i,
                              proc.returncode)
                    status = proc.returncode or 1
                    stopping.set()
                    break
                log.error("gateway worker %d exited with %s; restarting it", i, proc.returncode)
                await spawn(i)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await _stop_all([p for p, _ in procs.values()], settings.shutdown_timeout_s + 5.0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


async def _stop_all(procs: list[asyncio.subprocess.Process], timeout_s: float) -> None:
    """SIGTERM every worker (each stops cleanly: its spool closed intact), SIGKILL what outlives ``timeout_s``."""
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    waiting = [asyncio.ensure_future(p.wait()) for p in procs]
    if waiting:
        _, late = await asyncio.wait(waiting, timeout=timeout_s)
        for p in procs:
            if p.returncode is None:
                log.error("gateway worker pid %d did not stop within %.0fs; killed", p.pid, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        if late:
            await asyncio.wait(late)


def _mark_dead(pid: int) -> None:
    """Drop a dead worker's live gauges from the shared metrics."""
    from prometheus_client import multiprocess

    with contextlib.suppress(Exception):
        multiprocess.mark_process_dead(pid)
