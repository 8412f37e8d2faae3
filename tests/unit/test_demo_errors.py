"""A failed demo step is one line naming the step, why, and the log file; the traceback is in the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import paths
from services.tools.serving import free_port


def _demo(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "HOME": str(tmp_path / "home"), paths.CACHE_DIR_ENV: str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-m", "services.cli", "demo", "--queries", "10", "--out",
                           str(tmp_path / "out")], env=full, capture_output=True, text=True, timeout=240,
                          cwd=paths.REPO_ROOT)


@pytest.mark.slow
def test_a_step_that_fails_is_one_line_with_the_log_file(tmp_path: Path) -> None:
    """The real command with a broker that is not there: the gateway's start-up fails in step 2."""
    proc = _demo(tmp_path, KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    log_file = tmp_path / "out" / "demo.log"
    [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith("fanroute demo: failed at [2/8] starting the gateway: StartupFailed: gateway did not start")
    assert "BusError: cannot create topics" in line and line.endswith(f"(full log: {log_file})")
    assert "Traceback" not in proc.stdout + proc.stderr
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "--- demo failed at [2/8] starting the gateway ---" in text


def test_a_machine_that_is_not_ready_stops_before_anything_starts(tmp_path: Path) -> None:
    """The doctor runs first: collections pointed at an empty folder stop the demo with the fix."""
    (tmp_path / "empty").mkdir()
    proc = _demo(tmp_path, **{paths.COLLECTIONS_DIR_ENV: str(tmp_path / "empty")})
    assert proc.returncode == 1
    assert "this machine is not ready" in proc.stdout and "FAIL  collections" in proc.stdout
    assert f"unset {paths.COLLECTIONS_DIR_ENV}" in proc.stdout
    assert not (tmp_path / "out").exists()  # nothing was started or written
