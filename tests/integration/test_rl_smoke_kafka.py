"""The guide's one-step smoke on the real broker and redis-server with the real SmolLM2 and CPU sampler: one
task, a group of two router-harness rollouts in bubblewrap through the relay, one synchronous rl step, the
adapter published (the Redis stamp advances) — ``fanroute rl smoke`` as a function."""

from __future__ import annotations

import shutil
import uuid

import pytest

from schemas.rollout import RolloutGroup
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import RedisStampStore
from services.episodes.tasks import build_task, write_task
from services.tools.rl_recipes import run_recipe
from tests.support.records import NOW, judged_trace, verdict_for
from tests.support.topics import topic_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


async def test_the_one_step_smoke_runs_end_to_end(kafka_bootstrap, redis_url, tmp_path):
    ns = f"rs{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    task = build_task(judged_trace("t-smoke"), verdict_for("t-smoke"), now=NOW)
    write_task(task, tmp_path / "tasks")
    lines: list[str] = []
    summary = await run_recipe("smoke", kafka, redis, tmp_path / "tasks", tmp_path / "out", print_=lines.append)
    print(*lines, sep="\n")
    (step,) = summary["steps"]
    assert step["groups"] == 1 and step["requeues"] == 0 and step["lag_max"] == 0
    groups = await topic_records(kafka, "rollouts", RolloutGroup)
    (group,) = groups
    assert (group.task_id, group.model_id, group.adapter_version, len(group.rollouts)) == (
        task.task_id, summary["model_id"], 1, 2)  # stamped with the trainer's starting adapter
    for ro in group.rollouts:
        assert ro.outcome == "completed", (ro.reason, ro.harness)
        assert "router harness: model replied" in ro.harness.stdout and ro.verifier is not None
        assert len(ro.calls) == 1 and ro.calls[0].adapter == f"{summary['model_id']}@1" and ro.datums
        assert 0.0 <= ro.reward <= 1.0 and ro.reward_source == "reward.txt"
        assert any(w == 1.0 for w in ro.datums[0].loss_fn_inputs.weights)
    if group.uniform:
        assert step.get("skipped") == "every group uniform, nothing to train on"
        assert summary["version"] == 1
    else:
        assert step["trained_version"] == 2 and step["mismatch"] < 0.03 and step["rows"] == 2
    stamps = RedisStampStore(redis_url, ns)
    try:  # the starting adapter, then the step's (a uniform group trains nothing and publishes nothing)
        assert await stamps.get(summary["model_id"]) == (1 if group.uniform else 2)
    finally:
        await stamps.close()
    assert summary["wall_time_s"] > 0
