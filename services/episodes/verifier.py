"""Run a task's Harbor verifier locally (no Docker) and apply the reward-file contract.

Harbor runs ``tests/test.sh`` inside the task's container, with the agent's work in ``/app``, the
task's ``tests/`` copied to ``/tests`` and reward files expected in ``/logs/verifier/``. Here a temp
sandbox holds ``app/``, ``tests/`` and ``logs/verifier/``; in the *copied* test scripts (``*.sh``,
``*.py``, or any file starting with ``#!``) the absolute path prefixes ``/app``, ``/tests`` and
``/logs`` are rewritten to the sandbox's, and ``test.sh`` runs from ``app/`` as Harbor runs it from
the working directory. Data files (fixtures) are copied byte for byte, and the task's own files keep
the real paths. A script that builds those paths indirectly (``"/" + "app"``) is not remapped.

The reward contract itself is :mod:`services.common.reward_contract` (the rollout runner applies it too).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from services.common.reward_contract import (
    GraderRun,
    RewardSource,
    VerifierResult,
    apply_contract,
)

__all__ = ["RewardSource", "VerifierResult", "run_verifier"]

_REMAPPED = re.compile(r"(?<![\w.~/-])/(app|tests|logs)(?![\w.-])")
_SCRIPT_SUFFIXES = {".sh", ".bash", ".py"}


def _is_script(path: Path) -> bool:
    """A file whose absolute paths get remapped: by suffix, or a ``#!`` first line."""
    if path.suffix in _SCRIPT_SUFFIXES:
        return True
    with path.open("rb") as handle:
        return handle.read(2) == b"#!"


def _remap_scripts(tests_dir: Path, sandbox: Path) -> None:
    """Rewrite ``/app``, ``/tests``, ``/logs`` prefixes in the copied scripts to the sandbox's."""
    for path in sorted(tests_dir.rglob("*")):
        if not path.is_file() or not _is_script(path):
            continue
        try:
            text = path.read_bytes().decode("utf-8")  # bytes: line endings stay as they are
        except UnicodeDecodeError:
            continue
        path.write_bytes(_REMAPPED.sub(lambda m: str(sandbox / m.group(1)), text).encode("utf-8"))


def _prepare(task_dir: Path, sandbox: Path, answer: str | None) -> Path:
    """Lay out the sandbox and return the copied test.sh."""
    (sandbox / "app").mkdir()
    (sandbox / "logs" / "verifier").mkdir(parents=True)
    shutil.copytree(task_dir / "tests", sandbox / "tests")
    _remap_scripts(sandbox / "tests", sandbox)
    if answer is not None:
        # surrogatepass: an answer that is not valid text reaches the grader as invalid UTF-8.
        (sandbox / "app" / "answer.txt").write_bytes(answer.encode("utf-8", "surrogatepass"))
    return sandbox / "tests" / "test.sh"


def _text(output: bytes) -> str:
    """Captured output as text, undecodable bytes replaced."""
    return output.decode("utf-8", "replace")


def _run(script: Path, cwd: Path, timeout_s: float) -> GraderRun:
    """Run ``bash script`` in its own process group; on timeout kill the whole group."""
    proc = subprocess.Popen(["bash", str(script)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipes
            out, err = b"", b""
        timed_out = True
    return GraderRun(None if timed_out else proc.returncode, _text(out), _text(err), timed_out)


def run_verifier(task_dir: Path | str, answer: str | None, *, timeout_s: float = 60,
                 terminal_reward: float = 0.0) -> VerifierResult:
    """Run ``task_dir``'s tests/test.sh against ``answer`` (None: no answer file); never raises."""
    task_dir = Path(task_dir)
    try:
        if not (task_dir / "tests" / "test.sh").is_file():
            return VerifierResult(terminal_reward, "terminal", True, f"{task_dir} has no tests/test.sh")
        with tempfile.TemporaryDirectory(prefix="fanroute-verifier-",
                                         ignore_cleanup_errors=True) as tmp:
            sandbox = Path(tmp)
            script = _prepare(task_dir, sandbox, answer)
            run = _run(script, sandbox / "app", timeout_s)
            return apply_contract(sandbox / "logs" / "verifier", run, timeout_s, terminal_reward)
    except Exception as exc:  # noqa: BLE001 - a bad task run is a flagged result, never an exception
        return VerifierResult(terminal_reward, "terminal", True,
                              f"verifier could not run: {type(exc).__name__}: {exc}")
