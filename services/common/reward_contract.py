"""The reward contract of a Harbor verifier run: which file (or exit status) is the reward, and when
the grader itself is not trusted. Shared by the local verifier (episodes) and the rollout runner.

``reward.txt`` (one number) or ``reward.json`` (an object of named numbers, Harbor's multi-metric form;
``"reward"`` is the reward, or the only entry) - exactly one of them; both is a flagged error (Harbor
documents reward.txt-first, some versions read reward.json first, so two files are ambiguous). Neither:
exit status 0 scores 1.0, any other 0.0 (fanroute's fallback; Harbor itself fails the trial with
RewardFileNotFoundError). A grader that times out, dies by a signal, exits non-zero after a Python
traceback, or writes an unreadable reward file is not trusted: ``terminal_reward``, flagged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

RewardSource = Literal["reward.txt", "reward.json", "exit_status", "terminal"]

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
class GraderRun:
    """What running test.sh produced (exit status None: it did not finish)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool


class _BadRewardFile(ValueError):
    """A reward file exists but does not hold a usable reward."""


def _crash(run: GraderRun, timeout_s: float) -> str:
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


def apply_contract(logs: Path, run: GraderRun, timeout_s: float, terminal_reward: float) -> VerifierResult:
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
