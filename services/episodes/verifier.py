"""Run a task's Harbor verifier locally (no Docker) and apply the reward-file contract.

Harbor runs ``tests/test.sh`` inside the task's container, with the agent's work in ``/app``, the
task's ``tests/`` copied to ``/tests`` and reward files expected in ``/logs/verifier/``. Here a temp
sandbox holds ``app/``, ``tests/`` and ``logs/verifier/``; in the *copied* test scripts (``*.sh``,
``*.py``, or any file starting with ``#!``) the absolute path prefixes ``/app``, ``/tests`` and
``/logs`` are rewritten to the sandbox's, and ``test.sh`` runs from ``app/`` as Harbor runs it from
the working directory. Data files (fixtures) are copied byte for byte, and the task's own files keep
the real paths. A script that builds those paths indirectly (``"/" + "app"``) is not remapped.

Reward contract: ``reward.txt`` (one number) or ``reward.json`` (an object of named numbers, Harbor's
multi-metric form; ``"reward"`` is the reward, or the only entry) - exactly one of them; both is a
flagged error (Harbor documents reward.txt-first, some versions read reward.json first, so two files
are ambiguous). Neither: exit status 0 scores 1.0, any other 0.0 (fanroute's fallback; Harbor itself
fails the trial with RewardFileNotFoundError). A grader that times out, dies by a
signal, exits non-zero after a Python traceback, or writes an unreadable reward file is not trusted:
``terminal_reward``, flagged.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

RewardSource = Literal["reward.txt", "reward.json", "exit_status", "terminal"]

_REMAPPED = re.compile(r"(?<![\w.~/-])/(app|tests|logs)(?![\w.-])")
_SCRIPT_SUFFIXES = {".sh", ".bash", ".py"}
_TRACEBACK = "Traceback (most recent call last):"


@dataclass(frozen=True)
class VerifierResult:
    """The reward one verifier run earned, where it came from, and whether a human should look."""

    reward: float
    source: RewardSource
    flagged: bool
    reason: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    rewards: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Run:
    """What running test.sh produced."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool


class _BadRewardFile(ValueError):
    """A reward file exists but does not hold a usable reward."""


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


def _run(script: Path, cwd: Path, timeout_s: float) -> _Run:
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
    return _Run(None if timed_out else proc.returncode, _text(out), _text(err), timed_out)


def _crash(run: _Run, timeout_s: float) -> str:
    """Why the grader itself failed (timeout, signal, Python traceback), or ``""``."""
    if run.timed_out or run.exit_code is None:
        return f"grader timed out after {timeout_s:g}s"
    if run.exit_code < 0:
        return f"grader killed by signal {-run.exit_code}"
    if run.exit_code != 0 and (_TRACEBACK in run.stderr or _TRACEBACK in run.stdout):
        return f"grader crashed: Python traceback, exit status {run.exit_code}"
    return ""


def _number(value: object, what: str) -> float:
    """``value`` as a finite float, or :class:`_BadRewardFile`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadRewardFile(f"{what} is {value!r}, not a finite number")
    return float(value)


def _parse_txt(path: Path) -> dict[str, float]:
    """Harbor's reading of reward.txt: ``{"reward": float(text)}``."""
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text:
        raise _BadRewardFile("reward.txt is empty")
    try:
        value = float(text)
    except ValueError:
        raise _BadRewardFile(f"reward.txt holds {text[:80]!r}, not a number") from None
    return {"reward": _number(value, "reward.txt")}


def _parse_json(path: Path) -> dict[str, float]:
    """Harbor's reading of reward.json: an object of metric name -> number."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _BadRewardFile(f"reward.json is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise _BadRewardFile("reward.json must be a non-empty object of name -> number")
    return {str(k): _number(v, f"reward.json[{k!r}]") for k, v in data.items()}


def _headline(rewards: Mapping[str, float]) -> float:
    """The one reward of a metrics map: ``"reward"``, else its only entry."""
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    raise _BadRewardFile(f"reward.json has several metrics {sorted(rewards)} and no 'reward' key")


def _apply_contract(logs: Path, run: _Run, timeout_s: float, terminal_reward: float) -> VerifierResult:
    """The reward contract applied to one finished run."""
    def terminal(reason: str) -> VerifierResult:
        return VerifierResult(terminal_reward, "terminal", True, reason, run.stdout, run.stderr,
                              run.exit_code)

    crash = _crash(run, timeout_s)
    if crash:
        return terminal(crash)
    txt, js = logs / "reward.txt", logs / "reward.json"
    if txt.exists() and js.exists():
        return terminal("both reward.txt and reward.json were written; exactly one is allowed")
    for path, source, parse in ((txt, "reward.txt", _parse_txt), (js, "reward.json", _parse_json)):
        if path.exists():
            try:
                rewards = parse(path)
                reward = _headline(rewards)
            except (_BadRewardFile, OSError) as exc:
                return terminal(f"unusable {source}: {exc}")
            return VerifierResult(reward, source, False, f"{source}: {reward:g}", run.stdout,
                                  run.stderr, run.exit_code, rewards)
    reward = 1.0 if run.exit_code == 0 else 0.0
    return VerifierResult(reward, "exit_status", False,
                          f"no reward file; exit status {run.exit_code}", run.stdout, run.stderr,
                          run.exit_code)


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
            return _apply_contract(sandbox / "logs" / "verifier", run, timeout_s, terminal_reward)
    except Exception as exc:  # noqa: BLE001 - a bad task run is a flagged result, never an exception
        return VerifierResult(terminal_reward, "terminal", True,
                              f"verifier could not run: {type(exc).__name__}: {exc}")
