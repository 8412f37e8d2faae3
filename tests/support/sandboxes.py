"""Rollouts in a real sandbox for the sandbox tests: a recording stand-in for the relay's admin routes, the
replay task, a scripted harness, and :func:`roll` (one rollout with the given backend's settings, then the
checks every rollout must pass: its credential revoked, its workspace and its container gone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.task import Task
from services.episodes.tasks import build_task
from services.rollouts.relay_client import Ended
from services.rollouts.rollout import RolloutRun, run_rollout
from services.rollouts.sandbox import Sandbox, make_sandbox
from services.rollouts.settings import HarnessSettings, RolloutSettings, TerminalRewards
from tests.support.docker_engine import sandbox_containers
from tests.support.records import NOW, judged_trace, verdict_for

TERMINAL = TerminalRewards(context_exhausted=-0.25, timed_out=-0.5, harness_crashed=-1.0)


class FakeAdmin:
    """The relay's admin routes as the runner sees them, recording what it was asked."""

    def __init__(self) -> None:
        self.minted: list[str] = []
        self.revoked: list[str] = []

    async def mint(self, trace_id: str, ttl_s: float) -> str:
        self.minted.append(trace_id)
        return f"frt_token-of-{trace_id}"

    async def revoke(self, token: str) -> None:
        self.revoked.append(token)

    async def end(self, trace_id: str, advantage: float) -> Ended:
        return Ended(note="no relay calls recorded for this rollout")


def task() -> Task:
    return build_task(judged_trace(), verdict_for("t-1"), now=NOW)


def harness(tmp_path: Path, script: str, image: str | None = None) -> HarnessSettings:
    """``script`` as the harness (``bash /harness/h.sh``); ``image``: docker runs it there, not in the task's."""
    d = tmp_path / "harness"
    d.mkdir(exist_ok=True)
    (d / "h.sh").write_text(script)
    return HarnessSettings(name="test", directory=d, command=("bash", "/harness/h.sh"), image=image)


def left_behind(box: Sandbox, tmp_path: Path) -> list[str]:
    """Workspaces (and, for docker, containers) a finished rollout under ``tmp_path`` left behind."""
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("fanroute-rollout-")]
    if box.kind == "docker":
        left += [c.name for c in sandbox_containers(box.client, tmp_path)]  # type: ignore[attr-defined]
    return left


async def roll(tmp_path: Path, backend: Any, script: str, task_: Task | None = None, *, image: str | None = None,
               **kw: Any) -> RolloutRun:
    """One rollout of ``task_`` (the replay task) with ``script`` as the harness in ``backend``'s sandbox."""
    kw.setdefault("command_timeout_s", 20)
    settings = RolloutSettings(harness=harness(tmp_path, script, image), terminal_rewards=TERMINAL, admin_token="x",
                               sandbox=backend, work_dir=tmp_path, **kw)
    admin, box = FakeAdmin(), make_sandbox(settings.sandbox, settings.harness)
    run = await run_rollout(settings, box, admin, task_ or task(), "g-1-0", 0)
    assert admin.minted == ["g-1-0"] and admin.revoked == ["frt_token-of-g-1-0"]  # revoked at the end, always
    assert not left_behind(box, tmp_path)  # workspace (and container) removed
    return run
