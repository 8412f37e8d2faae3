"""Topic ``rollouts``: one group of rollouts of one replay task, with rewards, advantages and datums.

Producer: rollout runner. Consumer: the trainer's ``rl`` run kind (planned). A group is the unit the
trainer takes: ``group_size`` rollouts of the same task, all started under one adapter version (the
Redis stamp read when the group started, ``adapter_version``), each with its harness's output, the
relay calls it made, the reward the verifier gave (or a terminal reward), and the datums the relay
folded with ``advantage = reward - group mean`` on every sampled token. A group whose rewards are all
equal has ``uniform=True`` and zero advantages: nothing to train on.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from schemas.base import Message
from schemas.call import TRACE_ID_PATTERN, Call
from schemas.datum import Datum

#: How a rollout ended. ``completed``: the harness exited 0 and the verifier's reward counts (a grader
#: crash inside it is ``grader_crashed``: reward 0 and flagged). The others never reached the verifier
#: and score their configured terminal reward.
Outcome = Literal["completed", "grader_crashed", "timed_out", "harness_crashed", "context_exhausted",
                  "sandbox_failed"]
OUTCOMES: tuple[str, ...] = ("completed", "grader_crashed", "timed_out", "harness_crashed", "context_exhausted",
                             "sandbox_failed")


class CommandRun(Message):
    """One command run in the sandbox (the harness, or the verifier's test.sh): what it said and how it ended."""

    schema_version: Literal[1] = 1
    command: tuple[str, ...] = Field(min_length=1, description="argv as run inside the sandbox")
    exit_code: int | None = Field(description="Exit status (negative: killed by that signal); None = timed out")
    timed_out: bool = Field(description="Killed (the whole process group) at its timeout")
    timeout_s: float = Field(gt=0, description="The timeout it ran under")
    duration_s: float = Field(ge=0, description="Wall time")
    stdout: str = Field(default="", description="Standard output (truncated to the runner's limit)")
    stderr: str = Field(default="", description="Standard error (truncated to the runner's limit)")
    truncated: bool = Field(default=False, description="Whether stdout or stderr was cut")


class Rollout(Message):
    """One rollout: one sandbox, one episode at the relay (``trace_id``), one reward."""

    schema_version: Literal[1] = 1
    rollout_id: str = Field(min_length=1, max_length=160, description="``<group_id>:<index>``")
    trace_id: str = Field(pattern=TRACE_ID_PATTERN, description="The relay episode (``/tr/<trace_id>``)")
    index: int = Field(ge=0, description="Position in the group")
    outcome: Outcome
    reward: float = Field(description="The verifier's reward, or the outcome's terminal reward")
    reward_source: Literal["reward.txt", "reward.json", "exit_status", "terminal"]
    rewards: dict[str, float] = Field(default_factory=dict, description="reward.json's named metrics, if any")
    flagged: bool = Field(description="A person should look (grader crash, ambiguous reward files, sandbox failure)")
    reason: str = Field(default="", description="Why this reward (verifier's reason, or what ended the rollout)")
    answer: str | None = Field(default=None, description="What the harness left in /app/answer.txt (None: nothing)")
    harness: CommandRun | None = Field(description="The harness run (None: the sandbox never started it)")
    verifier: CommandRun | None = Field(default=None, description="The verifier run (None: not reached)")
    calls: tuple[Call, ...] = Field(default=(), description="The relay calls the harness made, in order")
    dispositions: dict[str, int] = Field(default_factory=dict, description="Calls per disposition")
    segments: int = Field(default=0, ge=0, description="Segments the calls folded into")
    advantage: float = Field(default=0.0, description="reward - the group's mean reward")
    datums: tuple[Datum, ...] = Field(default=(), description="The relay's datums, advantage on sampled tokens")
    started_at: datetime
    finished_at: datetime

    @model_validator(mode="after")
    def _consistent(self) -> Rollout:
        if any(c.trace_id != self.trace_id for c in self.calls):
            raise ValueError(f"rollout {self.rollout_id}: a call belongs to another trace")
        if any(d.trace_id not in (None, self.trace_id) for d in self.datums):
            raise ValueError(f"rollout {self.rollout_id}: a datum belongs to another trace")
        return self


class RolloutGroup(Message):
    """``group_size`` rollouts of one task under one adapter version: the unit the trainer takes."""

    schema_version: Literal[1] = 1
    group_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    task_id: str = Field(min_length=1, description="The replay task rolled out")
    task_trace_id: str = Field(min_length=1, description="The judged trace the task was built from")
    model_id: str = Field(min_length=1, max_length=128, description="The adapter's model id (the Redis stamp's)")
    adapter_version: int = Field(ge=0, description="The model id's Redis stamp when the group started (0 = base)")
    sandbox: Literal["bwrap", "docker"] = Field(description="The sandbox backend that ran it")
    harness: str = Field(min_length=1, max_length=128, description="The harness's name")
    rollouts: tuple[Rollout, ...] = Field(min_length=1)
    reward_mean: float = Field(description="Mean reward of the group (what the advantages are taken from)")
    uniform: bool = Field(description="Every reward equal: no advantage, nothing to train on")
    started_at: datetime
    finished_at: datetime

    @property
    def rewards_G(self) -> tuple[float, ...]:
        """The group's rewards, in rollout order."""
        return tuple(r.reward for r in self.rollouts)

    @model_validator(mode="after")
    def _consistent(self) -> RolloutGroup:
        if [r.index for r in self.rollouts] != list(range(len(self.rollouts))):
            raise ValueError(f"group {self.group_id}: rollouts must be indexed 0..{len(self.rollouts) - 1}")
        if any(not r.rollout_id.startswith(f"{self.group_id}:") for r in self.rollouts):
            raise ValueError(f"group {self.group_id}: rollout ids must be '<group_id>:<index>'")
        return self
