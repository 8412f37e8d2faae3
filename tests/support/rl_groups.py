"""Hand-made rollout groups for the RL trainer's tests: a runner's output without a sandbox or a sampler."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from schemas.datum import Datum, EncodedTextChunk, LossFnInputs, ModelInput
from schemas.rollout import Rollout, RolloutGroup
from schemas.task import Task

_ids = itertools.count()


def datum(trace_id: str, advantage: float, prompt: tuple[int, ...] = tuple(range(5, 15)),
          sampled: tuple[int, ...] = (20, 21, 22, 23)) -> Datum:
    """One segment: ``prompt`` then ``sampled`` (logprob -1.5 each, ``advantage`` on them)."""
    tokens = prompt + sampled
    n = len(tokens) - 1
    w = [1.0 if i + 1 >= len(prompt) else 0.0 for i in range(n)]
    return Datum(trace_id=trace_id, segment_index=0, call_indices=(0,),
                 model_input=ModelInput(chunks=(EncodedTextChunk(tokens=tokens[:-1]),)),
                 loss_fn_inputs=LossFnInputs(target_tokens=tokens[1:], weights=tuple(w),
                                             logprobs=tuple(-1.5 * x for x in w),
                                             advantages=tuple(advantage * x for x in w)))


def group(task: Task, rewards: list[float], version: int, model_id: str = "router") -> RolloutGroup:
    """A finished group of ``task`` stamped ``version``, advantages as the runner computes them."""
    gid = f"g-test{next(_ids)}"
    now = datetime.now(UTC)
    mean = sum(rewards) / len(rewards)
    uniform = len(set(rewards)) == 1
    rollouts = []
    for i, r in enumerate(rewards):
        adv = 0.0 if uniform else r - mean
        tid = f"{gid}-{i}"
        rollouts.append(Rollout(rollout_id=f"{gid}:{i}", trace_id=tid, index=i, outcome="completed", reward=r,
                                reward_source="reward.txt", flagged=False, harness=None, advantage=adv,
                                datums=(datum(tid, adv),), started_at=now, finished_at=now))
    return RolloutGroup(group_id=gid, task_id=task.task_id, task_trace_id=task.trace_id, model_id=model_id,
                        adapter_version=version, sandbox="bwrap", harness="router", rollouts=tuple(rollouts),
                        reward_mean=mean, uniform=uniform, started_at=now, finished_at=now)
