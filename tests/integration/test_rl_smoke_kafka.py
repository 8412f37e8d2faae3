"""The guide's one-step smoke on the real broker and redis-server with the real SmolLM2 and CPU sampler: one
task, a group of two router-harness rollouts in bubblewrap through the relay, one synchronous rl step, the
adapter published (the Redis stamp advances) — ``fanroute rl smoke`` as a function.

The policy starts from a LoRA adapter SFT-trained here for a few seconds to answer in the router's format
with the task's providers in a random order: the bare base model answers the query instead (both rollouts
score 0, a uniform group, nothing to train on), while this one's rollouts differ, so the step trains.
The preflight (every task once, untrained policy) counts a task whose grader crashes as a non-model error.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import uuid
from pathlib import Path

import pytest

from schemas.rollout import RolloutGroup
from schemas.task import Task, task_id_of
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import RedisStampStore
from services.episodes.tasks import build_task, write_task
from services.tools.rl_recipes import run_recipe
from tests.support.records import NOW, episode, judged_trace, verdict_for
from tests.support.topics import topic_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


PROVIDERS = ("bm25-all", "dense-all", "eng-bm25", "lib-bm25")  # judged_trace's


def format_adapter(out: Path) -> Path:
    """SmolLM2 + LoRA trained on 32 router answers naming PROVIDERS in a random order (one pass, 8 steps).

    The whole ordering is the target: under the trainer's default (``first``) the adapter answers one name,
    bm25-all or eng-bm25 (graded alike), and two rollouts tie on about 77 % of tries (40 samples)."""
    from services.models.prepare import DEFAULT_BASE, resolve_base
    from services.trainer.settings import TrainerSettings
    from services.trainer.train import train

    rng = random.Random(0)
    eps = [episode(f"question {i}: {rng.choice(('aero', 'med', 'law', 'code'))} topic {rng.randrange(1000)}",
                   " > ".join(rng.sample(PROVIDERS, len(PROVIDERS))), PROVIDERS, ep_id=f"e-{i}") for i in range(32)]
    train(TrainerSettings(base_model=str(resolve_base(DEFAULT_BASE, prepare=True)), output_dir=out, batch_size=4,
                          lr=3e-3, lr_schedule="constant", eval_fraction=0.0, eval_every=0, checkpoint_every=0,
                          allow_uncalibrated=True, run={"type": "sft", "target": "ordering"}),
          episodes=eps, gate_lookup=lambda key, labels: None)
    return out / "adapter"


async def test_the_one_step_smoke_runs_end_to_end(kafka_bootstrap, redis_url, tmp_path):
    ns = f"rs{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    task = build_task(judged_trace("t-smoke"), verdict_for("t-smoke"), now=NOW)
    write_task(task, tmp_path / "tasks")
    lines: list[str] = []
    summary = await run_recipe("smoke", kafka, redis, tmp_path / "tasks", tmp_path / "out", print_=lines.append,
                               init_adapter=await asyncio.to_thread(format_adapter, tmp_path / "sft"))
    print(*lines, sep="\n")
    (step,) = summary["steps"]
    assert step["groups"] == 1 and step["requeues"] == 0 and step["lag_max"] == 0
    groups = await topic_records(kafka, "rollouts", RolloutGroup)
    assert len(groups) == step["uniform_resampled"] + 1  # uniform groups set aside, then the one trained on
    # the topic has 3 partitions keyed by group id: records come back per partition, not in publish order
    (group,) = [g for g in groups if not g.uniform]
    assert (group.task_id, group.model_id, group.adapter_version, len(group.rollouts)) == (
        task.task_id, summary["model_id"], 1, 2)  # stamped with the trainer's starting adapter
    for ro in group.rollouts:
        assert ro.outcome == "completed", (ro.reason, ro.harness)
        assert "router harness: model replied" in ro.harness.stdout and ro.verifier is not None
        assert len(ro.calls) == 1 and ro.calls[0].adapter == f"{summary['model_id']}@1" and ro.datums
        assert 0.0 <= ro.reward <= 1.0 and ro.reward_source == "reward.txt"
        assert any(w == 1.0 for w in ro.datums[0].loss_fn_inputs.weights)
    assert len({g.group_id for g in groups}) == len(groups)  # one id per task record, never reused
    assert group.rollouts[0].reward != group.rollouts[1].reward
    assert step["trained_version"] == 2 and step["mismatch"] < 0.03 and step["rows"] == 2
    assert summary["version"] == 2
    stamps = RedisStampStore(redis_url, ns)
    try:  # the starting adapter was version 1; the step's is 2
        assert await stamps.get(summary["model_id"]) == 2
    finally:
        await stamps.close()
    assert summary["wall_time_s"] > 0


async def test_the_preflight_counts_a_broken_grader_as_a_non_model_error(kafka_bootstrap, redis_url, tmp_path):
    ns = f"rp{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    good = build_task(judged_trace("t-good"), verdict_for("t-good"), now=NOW)
    files = dict(build_task(judged_trace("t-bad"), verdict_for("t-bad"), now=NOW).files)
    files["tests/fixtures/grades.json"] = '{"providers": []}'  # the grader raises before writing a reward
    bad = Task(task_id=task_id_of(files), trace_id="t-bad", created_at=NOW, files=files)
    for t in (good, bad):
        write_task(t, tmp_path / "tasks")
    summary = await run_recipe("preflight", kafka, redis, tmp_path / "tasks", tmp_path / "out", max_tokens=8,
                               print_=print)
    assert (summary["tasks"], summary["groups"], summary["rollouts"], summary["missing_groups"]) == (2, 2, 2, 0)
    assert summary["outcomes"] == {"completed": 1, "grader_crashed": 1}
    assert (summary["non_model_errors"], summary["non_model_error_rate"], summary["flagged"]) == (1, 0.5, 1)
    assert summary["no_calls"] == 0  # both harnesses asked the base policy through the relay
