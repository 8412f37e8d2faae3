"""Gateway workers (``FANROUTE_WORKERS``): who owns which spool, adopting what a gone worker left, bad settings."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from services.common.spool import Spool
from services.gateway.settings import GatewaySettings
from services.gateway.workers import adopt, orphan_spool_dirs, supervise, worker_spool_dir
from tests.support.processes import ROOT


def _settings(workers: int = 1, index: int | None = None, **kw) -> GatewaySettings:
    return GatewaySettings(workers=workers, worker_index=index, kafka={"bootstrap_servers": "memory://"}, **kw)


def _spool_with(directory, n: int) -> None:
    s = Spool(directory, "traces")
    s.open()
    for i in range(n):
        s.append("traces", f'{{"n": {i}}}'.encode(), key=f"k{i}".encode(), headers={"h": "v"})
    s.close()


def test_each_worker_has_its_own_spool_directory(tmp_path):
    assert worker_spool_dir(tmp_path, _settings()) == tmp_path
    assert worker_spool_dir(tmp_path, _settings(3, 2)) == tmp_path / "worker-2"


def test_orphaned_spools_go_to_one_live_worker_each(tmp_path):
    for j in (0, 1, 2, 3, 4):
        (tmp_path / f"worker-{j}").mkdir()
    (tmp_path / "worker-x").mkdir()  # not a worker's directory
    _spool_with(tmp_path, 1)  # a single-process run's spool
    owners = {i: orphan_spool_dirs(tmp_path, _settings(2, i)) for i in (0, 1)}
    assert owners[0] == [tmp_path, tmp_path / "worker-2", tmp_path / "worker-4"]
    assert owners[1] == [tmp_path / "worker-3"]
    # back to one process: it takes every worker's directory
    assert orphan_spool_dirs(tmp_path, _settings()) == [tmp_path / f"worker-{j}" for j in range(5)]


def test_adopting_moves_every_pending_record_and_empties_the_old_spool(tmp_path):
    _spool_with(tmp_path / "worker-3", 3)
    own = Spool(tmp_path / "worker-0", "traces")
    own.open()
    assert adopt([tmp_path / "worker-3"], own) == 3
    assert [(r.key, r.value, r.headers) for r in own.pending()] == [
        (f"k{i}".encode(), f'{{"n": {i}}}'.encode(), {"h": "v"}) for i in range(3)]
    own.close()
    old = Spool(tmp_path / "worker-3", "traces")
    assert old.open() == []
    old.close()


def test_a_spool_still_in_use_is_not_adopted(tmp_path):
    _spool_with(tmp_path / "worker-3", 2)
    live = Spool(tmp_path / "worker-3", "traces")
    live.open()  # another process's lock
    own = Spool(tmp_path / "worker-0", "traces")
    own.open()
    try:
        assert adopt([tmp_path / "worker-3"], own) == 0 and own.depth == 0
    finally:
        own.close()
        live.close()


def test_bad_worker_settings_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="worker_index 2 must be below workers"):
        _settings(2, 2)
    with pytest.raises(ValidationError, match="workers"):
        _settings(0)


def test_supervising_needs_a_fixed_port_and_a_free_one():
    with pytest.raises(ValueError, match="fixed FANROUTE_PORT"):
        asyncio.run(supervise(_settings(2, port=0)))
    with socket.socket() as plain:  # a port held without SO_REUSEPORT cannot be shared: refused before any worker
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError):
            asyncio.run(supervise(_settings(2, port=plain.getsockname()[1])))


def test_the_entry_point_lists_the_setting_and_refuses_a_bad_one():
    out = subprocess.run([sys.executable, "-m", "services.gateway", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "FANROUTE_WORKERS" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "services.gateway"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "FANROUTE_WORKERS": "0",
                                          "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "workers" in bad.stderr
