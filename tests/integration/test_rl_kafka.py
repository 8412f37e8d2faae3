"""Run kind rl on the real broker, the runner played by the test: a group stamped before the run is requeued
(its task goes out on ``tasks`` again), a uniform group is reported and counted, and the step trains on the
rest and publishes; with dynamic sampling a uniform group is set aside and the next task rolled out in its
place, or the same one when it is the only task (the tiny model; the sandboxed end to end run is
test_rl_smoke_kafka.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from schemas import topic
from schemas.task import Task
from services.common.bus import publish_once
from services.common.settings import KafkaSettings
from services.episodes.tasks import build_task
from services.trainer.rl import train_rl_async
from services.trainer.settings import TrainerSettings
from tests.support.records import NOW, judged_trace, verdict_for
from tests.support.rl_groups import group
from tests.support.tiny_model import build_tiny_model
from tests.support.topics import wait_for_records

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class CountingPublisher:
    """Versions 1, 2, ... as the publisher would stamp them."""

    def __init__(self) -> None:
        self.published: list[dict] = []

    def publish(self, model_id, adapter_dir, base_model, metrics):
        self.published.append(dict(metrics))
        return {"model_id": model_id, "version": len(self.published)}


async def test_a_stale_group_is_requeued_and_a_uniform_group_reported(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"rl{uuid.uuid4().hex[:8]}.")
    base = build_tiny_model(tmp_path / "base")
    tasks = [build_task(judged_trace(f"t{i}"), verdict_for(f"t{i}"), now=NOW) for i in range(2)]
    settings = TrainerSettings(kafka=kafka, base_model=str(base), output_dir=tmp_path / "run", max_steps=1,
                               max_tokens=64, eval_fraction=0.0, checkpoint_every=0, eval_every=0, model_id="router",
                               run={"type": "rl", "groups_per_batch": 2, "max_steps_off_policy": 0,
                                    "batch_timeout_s": 120})
    publisher, lines = CountingPublisher(), []
    trainer = asyncio.create_task(train_rl_async(settings, tasks=tasks, publisher=publisher, out=lines.append))
    try:
        sent = await wait_for_records(kafka, "tasks", Task, 2, timeout_s=120, what="the run's first two tasks")
        assert {t.task_id for t in sent} == {t.task_id for t in tasks}
        first, second = sent
        await publish_once(kafka, topic("rollouts"), group(first, [1.0, 0.0], version=0), client_id="test")
        again = await wait_for_records(kafka, "tasks", Task, 3, timeout_s=120, what="the stale group's task requeued")
        assert again[2].task_id == first.task_id  # re-rolled under the current adapter, not trained on
        await publish_once(kafka, topic("rollouts"), group(second, [0.5, 0.5], version=1), client_id="test")
        await publish_once(kafka, topic("rollouts"), group(first, [1.0, 0.0], version=1), client_id="test")
        result = await asyncio.wait_for(trainer, 180)
    finally:
        trainer.cancel()
    print(*lines, sep="\n")
    assert result.trained and len(publisher.published) == 2  # the starting adapter, then step 1
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (rec,) = [r for r in steps if r.get("step") == 1 and "event" not in r]
    assert (rec["requeues"], rec["uniform_groups"], rec["groups"], rec["rows"]) == (1, 1, 2, 2)
    assert (rec["lag_mean"], rec["lag_max"], rec["sampled_versions"], rec["trained_version"]) == (0, 0, [1], 2)
    assert rec["reward/mean"] == pytest.approx(0.5) and rec["grad_norm"] > 0
    assert any("requeued group" in ln and "inf steps behind" in ln for ln in lines)


@pytest.mark.parametrize("n_tasks", [1, 3])
async def test_dynamic_sampling_sets_a_uniform_group_aside_and_rolls_out_the_next_task(kafka_bootstrap, tmp_path,
                                                                                     n_tasks):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"rl{uuid.uuid4().hex[:8]}.")
    base = build_tiny_model(tmp_path / "base")
    tasks = [build_task(judged_trace(f"t{i}"), verdict_for(f"t{i}"), now=NOW) for i in range(n_tasks)]
    settings = TrainerSettings(kafka=kafka, base_model=str(base), output_dir=tmp_path / "run", max_steps=1,
                               max_tokens=64, eval_fraction=0.0, checkpoint_every=0, eval_every=0, model_id="router",
                               run={"type": "rl", "groups_per_batch": 1, "max_steps_off_policy": 0,
                                    "batch_timeout_s": 120, "resample_uniform": 2})
    publisher, lines = CountingPublisher(), []
    trainer = asyncio.create_task(train_rl_async(settings, tasks=tasks, publisher=publisher, out=lines.append))
    try:
        (first,) = await wait_for_records(kafka, "tasks", Task, 1, timeout_s=120, what="the run's first task")
        await publish_once(kafka, topic("rollouts"), group(first, [0.0, 0.0], version=1), client_id="test")
        sent = await wait_for_records(kafka, "tasks", Task, 2, timeout_s=120, what="a task in the uniform one's place")
        second = sent[1]
        # another prompt, not the one the policy just answered alike; the same one when it is the only task
        assert (second.task_id == first.task_id) == (n_tasks == 1)
        await publish_once(kafka, topic("rollouts"), group(second, [0.0, 1.0], version=1), client_id="test")
        result = await asyncio.wait_for(trainer, 180)
    finally:
        trainer.cancel()
    assert result.trained and len(publisher.published) == 2
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (rec,) = [r for r in steps if r.get("step") == 1 and "event" not in r]
    assert (rec["uniform_resampled"], rec["uniform_groups"], rec["groups"], rec["rows"]) == (1, 0, 1, 2)
    assert rec["reward/mean"] == pytest.approx(0.5) and rec["trained_version"] == 2
    said = "its task is rolled out again" if n_tasks == 1 else f"task {second.task_id[:12]} is rolled out in its place"
    assert any("uniform group" in ln and said in ln for ln in lines)
