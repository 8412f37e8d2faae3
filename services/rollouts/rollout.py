"""One rollout: a workspace from the task, a one-episode credential, the harness in the sandbox, then the
task's verifier in the same workspace, and the reward by the contract (or a terminal reward).

Why here and not in the group: each rollout is independent (its own sandbox, trace id and token); only the
advantage needs the group, and it is applied when the relay folds the episode's calls afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime

from schemas.rollout import CommandRun, Outcome
from schemas.task import Task
from services.common.reward_contract import GraderRun, apply_contract
from services.common.rewards import TaskCostsError, cost_aware, task_costs
from services.rollouts.forward import RelayForward
from services.rollouts.relay_client import RelayAdmin
from services.rollouts.sandbox import Sandbox, Workspace
from services.rollouts.settings import RolloutSettings

log = logging.getLogger(__name__)
VERIFIER = ("bash", "/tests/test.sh")
# The verifier shares /root with the harness that ran before it: no usercustomize or .pth the harness left in
# the user site-packages (~/.local) may run in the grader's Python.
VERIFIER_ENV = {"PYTHONNOUSERSITE": "1"}


@dataclass(frozen=True)
class RolloutRun:
    """What one rollout produced before its group's advantage is known."""

    index: int
    trace_id: str
    outcome: Outcome
    reward: float
    reward_source: str
    flagged: bool
    reason: str
    started_at: datetime
    finished_at: datetime
    answer: str | None = None
    harness: CommandRun | None = None
    verifier: CommandRun | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    relay_connections: int = 0


def harness_env(base_url: str, trace_id: str, token: str, settings: RolloutSettings) -> dict[str, str]:
    """The sandbox's environment: our variables and both SDKs' base URL and key, all pointed at the episode."""
    root = f"{base_url.rstrip('/')}/tr/{trace_id}"
    h = settings.harness
    return {"FANROUTE_BASE_URL": root, "FANROUTE_TRACE_TOKEN": token, "FANROUTE_MODEL": settings.model_id,
            "OPENAI_BASE_URL": f"{root}/v1", "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": token,
            "FANROUTE_HARNESS_MAX_TOKENS": str(h.max_tokens), "FANROUTE_HARNESS_TEMPERATURE": str(h.temperature),
            "FANROUTE_HARNESS_TIMEOUT_S": str(h.request_timeout_s),
            "FANROUTE_HARNESS_CONTEXT_EXIT": str(h.context_exhausted_exit_code)}


def task_timeouts(task: Task) -> tuple[float, float]:
    """(agent, verifier) ``timeout_sec`` from the task's task.toml (inf where it names none)."""
    try:
        toml = tomllib.loads(task.files.get("task.toml", ""))
    except tomllib.TOMLDecodeError:
        return math.inf, math.inf

    def sec(table: str) -> float:
        value = toml.get(table, {}).get("timeout_sec")
        return float(value) if isinstance(value, int | float) and value > 0 else math.inf

    return sec("agent"), sec("verifier")


def _tail(text: str, n: int = 300) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-n:] if lines else ""


def _harness_verdict(run: CommandRun, settings: RolloutSettings) -> tuple[Outcome, float, str] | None:
    """The terminal outcome of a harness run that does not reach the verifier, or None (it exited 0)."""
    t = settings.terminal_rewards
    if run.timed_out:
        return "timed_out", t.timed_out, f"harness timed out after {run.timeout_s:g}s (killed with all it started)"
    if run.exit_code == settings.harness.context_exhausted_exit_code:
        return "context_exhausted", t.context_exhausted, f"harness ran out of context: {_tail(run.stderr)}"
    if run.exit_code != 0:
        return "harness_crashed", t.harness_crashed, (f"harness exited with status {run.exit_code}: "
                                                      f"{_tail(run.stderr) or _tail(run.stdout)}")
    return None


async def run_rollout(settings: RolloutSettings, sandbox: Sandbox, admin: RelayAdmin, task: Task, trace_id: str,
                      index: int) -> RolloutRun:
    """Run one rollout of ``task`` as episode ``trace_id``; the relay's own errors propagate (transient)."""
    started, clock0 = datetime.now(UTC), time.monotonic()
    deadline = clock0 + settings.sandbox_timeout_s
    agent_s, verifier_s = task_timeouts(task)
    limit = settings.output_limit_bytes

    def done(outcome: Outcome, reward: float, source: str, flagged: bool, reason: str, **kw: object) -> RolloutRun:
        return RolloutRun(index=index, trace_id=trace_id, outcome=outcome, reward=reward, reward_source=source,
                          flagged=flagged, reason=reason, started_at=started, finished_at=datetime.now(UTC),
                          **kw)  # type: ignore[arg-type]

    ws = Workspace.create(task.files, settings.work_dir)
    token: str | None = None
    try:
        token = await admin.mint(trace_id, settings.credential_ttl_s)
        try:
            await sandbox.prepare(ws)
            env = harness_env(sandbox.relay_base_url, trace_id, token, settings)
            budget = min(settings.command_timeout_s, agent_s, deadline - time.monotonic())
            if budget <= 0:  # the sandbox took the whole budget to start (a long image build)
                return done("timed_out", settings.terminal_rewards.timed_out, "terminal", False,
                            f"the rollout's budget ({settings.sandbox_timeout_s:g}s) ran out before the harness")
            async with RelayForward(ws.socket, settings.relay_url) as fwd:  # every backend binds this socket in
                harness = await sandbox.run(ws, "harness", settings.harness.command, env, budget, limit)
            connections = fwd.connections
        except OSError as exc:  # bwrap missing, no room for the workspace, the image would not build (SandboxError)
            log.error("rollout %s: the sandbox failed: %s", trace_id, exc)
            return done("sandbox_failed", settings.terminal_rewards.harness_crashed, "terminal", True,
                        f"sandbox failed: {type(exc).__name__}: {exc}")
        answer = ws.answer()
        common = {"answer": answer, "harness": harness, "relay_connections": connections}
        if (terminal := _harness_verdict(harness, settings)) is not None:
            outcome, reward, reason = terminal
            return done(outcome, reward, "terminal", False, reason, **common)
        left = deadline - time.monotonic()
        if left <= 0.5:
            return done("timed_out", settings.terminal_rewards.timed_out, "terminal", False,
                        f"the rollout's budget ({settings.sandbox_timeout_s:g}s) ran out before the verifier", **common)
        v_budget = min(settings.command_timeout_s, verifier_s, left)
        try:
            vrun = await sandbox.run(ws, "verifier", VERIFIER, VERIFIER_ENV, v_budget, limit)
        except OSError as exc:
            return done("sandbox_failed", 0.0, "terminal", True, f"the verifier could not start: {exc}", **common)
        result = apply_contract(ws.logs / "verifier", GraderRun(vrun.exit_code, vrun.stdout, vrun.stderr,
                                                                vrun.timed_out), v_budget, 0.0)
        outcome: Outcome = "grader_crashed" if result.source == "terminal" else "completed"
        reward, rewards, flagged, reason = result.reward, dict(result.rewards), result.flagged, result.reason
        if settings.reward == "ndcg_cost" and outcome == "completed":
            try:
                rewards |= cost_aware(reward, answer, task_costs(task.files), settings.cost_weight)
                reward = rewards["ndcg_cost"]
            except TaskCostsError as exc:  # the task's fault, not the answer's: a person should look
                flagged, reason = True, f"ndcg_cost not computed, the verifier's reward kept: {exc}"
        return done(outcome, reward, result.source, flagged, reason, verifier=vrun, rewards=rewards, **common)
    finally:
        if token is not None:
            with contextlib.suppress(Exception):
                await admin.revoke(token)
        with contextlib.suppress(Exception):
            await sandbox.close(ws)
        ws.remove()
