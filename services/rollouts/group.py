"""A group: ``group_size`` rollouts of one task under the adapter version stamped when it started, each
rollout's advantage = its reward - the group's mean, folded by the relay onto its datums' sampled tokens.

Why a shared semaphore: ``max_parallel`` bounds sandboxes in flight across every group at once, so the
runner never launches more than the machine (or the trainer's staleness ceiling) can use.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.rollout import OUTCOMES, Rollout, RolloutGroup
from schemas.task import Task
from services.common.errors import TransientError
from services.common.stamps import StampStore
from services.rollouts.relay_client import RelayAdmin
from services.rollouts.rollout import RolloutRun, run_rollout
from services.rollouts.sandbox import Sandbox
from services.rollouts.settings import RolloutSettings

log = logging.getLogger(__name__)
UNIFORM = "uniform group, nothing to train on"


class RunnerMetrics:
    """Rollouts by outcome, groups, uniform groups, sandboxes in flight, the parallelism and its ceiling."""

    def __init__(self, settings: RolloutSettings) -> None:
        r = self.registry = CollectorRegistry()
        self.rollouts = Counter("fanroute_rollouts", "Rollouts finished, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.rollouts.labels(outcome)
        self.groups = Counter("fanroute_rollout_groups", "Groups published", registry=r)
        self.uniform = Counter("fanroute_rollout_groups_uniform",
                               "Groups whose rewards were all equal (nothing to train on)", registry=r)
        self.flagged = Counter("fanroute_rollouts_flagged", "Rollouts flagged for a person", registry=r)
        self.failed = Counter("fanroute_rollout_groups_failed", "Groups given up on (relay, Redis or Kafka down)",
                              registry=r)
        self.in_flight = Gauge("fanroute_rollout_sandboxes_in_flight", "Sandboxes running now", registry=r)
        self.max_parallel = Gauge("fanroute_rollout_max_parallel", "Configured max_parallel", registry=r)
        self.ceiling = Gauge("fanroute_rollout_ceiling",
                             "(max_steps_off_policy + 1) x groups_per_batch x group_size", registry=r)
        self.latest = Gauge("fanroute_rollout_adapter_latest", "Newest adapter version seen on adapters", registry=r)
        self.seconds = Histogram("fanroute_rollout_seconds", "Wall time of one rollout", registry=r,
                                 buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.max_parallel.set(settings.max_parallel)
        self.ceiling.set(settings.ceiling)
        self.uniform_groups = 0  # plain counts too, for reports and tests
        self.rollouts_by_outcome: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.peak_in_flight = 0


def ceiling_report(settings: RolloutSettings) -> str:
    """``max_parallel`` next to the algorithmic ceiling, and a warning when it is over it."""
    s = settings
    text = (f"max_parallel {s.max_parallel} sandboxes in flight; algorithmic ceiling (max_steps_off_policy + 1) x "
            f"groups_per_batch x group_size = ({s.max_steps_off_policy} + 1) x {s.groups_per_batch} x {s.group_size}"
            f" = {s.ceiling}")
    if s.max_parallel > s.ceiling:
        text += " - max_parallel is over it: the extra rollouts would be too stale for the trainer to accept"
    return text


def advantages(rewards_G: list[float]) -> tuple[float, list[float], bool]:
    """(mean, reward - mean per rollout, uniform): all-equal rewards give zero advantages and ``uniform``."""
    mean = math.fsum(rewards_G) / len(rewards_G)
    uniform = all(math.isclose(r, rewards_G[0], rel_tol=0.0, abs_tol=1e-12) for r in rewards_G)
    return mean, [0.0 if uniform else r - mean for r in rewards_G], uniform


class GroupRunner:
    """Runs groups of rollouts against one sandbox backend, relay and stamp store."""

    def __init__(self, settings: RolloutSettings, sandbox: Sandbox, admin: RelayAdmin, stamps: StampStore,
                 metrics: RunnerMetrics | None = None) -> None:
        self.settings, self.sandbox, self.admin, self.stamps = settings, sandbox, admin, stamps
        self.metrics = metrics or RunnerMetrics(settings)
        self.slots = asyncio.Semaphore(settings.max_parallel)
        self._in_flight = 0

    async def _one(self, task: Task, trace_id: str, index: int) -> RolloutRun:
        async with self.slots:
            self._in_flight += 1
            self.metrics.in_flight.set(self._in_flight)
            self.metrics.peak_in_flight = max(self.metrics.peak_in_flight, self._in_flight)
            try:
                with self.metrics.seconds.time():
                    return await run_rollout(self.settings, self.sandbox, self.admin, task, trace_id, index)
            finally:
                self._in_flight -= 1
                self.metrics.in_flight.set(self._in_flight)

    async def run_group(self, task: Task, group_id: str | None = None) -> RolloutGroup:
        """``group_size`` rollouts of ``task``, stamped, rewarded, advantaged and folded into datums."""
        s = self.settings
        group_id = group_id or f"g-{uuid.uuid4().hex[:24]}"
        try:
            version = await self.stamps.get(s.model_id)
        except Exception as exc:  # Redis down: the worker retries the group
            raise TransientError(f"cannot read the adapter stamp of {s.model_id}: {exc}") from exc
        started = datetime.now(UTC)
        runs = await asyncio.gather(*(self._one(task, f"{group_id}-{i}", i) for i in range(s.group_size)))
        mean, advs, uniform = advantages([r.reward for r in runs])
        rollouts = []
        for run, adv in zip(runs, advs):
            ended = await self.admin.end(run.trace_id, adv)
            reason = run.reason if not ended.note else f"{run.reason}; {ended.note}"
            if ended.note and run.relay_connections == 0 and run.harness is not None:
                reason += " (the harness never connected to the relay)"
            rollouts.append(Rollout(
                rollout_id=f"{group_id}:{run.index}", trace_id=run.trace_id, index=run.index, outcome=run.outcome,
                reward=run.reward, reward_source=run.reward_source, rewards=run.rewards,  # type: ignore[arg-type]
                flagged=run.flagged, reason=reason, answer=run.answer, harness=run.harness, verifier=run.verifier,
                calls=ended.calls, dispositions=ended.dispositions, segments=ended.segments, advantage=adv,
                datums=ended.datums, started_at=run.started_at, finished_at=run.finished_at))
        group = RolloutGroup(group_id=group_id, task_id=task.task_id, task_trace_id=task.trace_id, model_id=s.model_id,
                             adapter_version=version, sandbox=self.sandbox.kind, harness=s.harness.name,
                             rollouts=tuple(rollouts), reward_mean=mean, uniform=uniform, started_at=started,
                             finished_at=datetime.now(UTC))
        self._count(group)
        return group

    def _count(self, group: RolloutGroup) -> None:
        m = self.metrics
        for r in group.rollouts:
            m.rollouts.labels(r.outcome).inc()
            m.rollouts_by_outcome[r.outcome] += 1
            if r.flagged:
                m.flagged.inc()
                log.warning("rollout %s flagged: %s", r.rollout_id, r.reason)
        rewards = ", ".join(f"{x:g}" for x in group.rewards_G)
        if group.uniform:
            m.uniform.inc()
            m.uniform_groups += 1
            log.info("group %s (task %s, %s@%d): %s (rewards %s)", group.group_id, group.task_id[:12],
                     group.model_id, group.adapter_version, UNIFORM, rewards)
        else:
            log.info("group %s (task %s, %s@%d): rewards %s, mean %.4f", group.group_id, group.task_id[:12],
                     group.model_id, group.adapter_version, rewards, group.reward_mean)
