"""The runner's ledger: an accepted task record stays pending until its group is published; a transient failure
leaves it for the next start, any other failure drops it; a restart runs what is left; a redelivered record
(pending or done) is not run again."""

from __future__ import annotations

import pytest

from schemas.rollout import RolloutGroup
from services.common.bus import RecordRef
from services.common.errors import TransientError
from services.episodes.tasks import build_task
from services.rollouts import worker as worker_mod
from services.rollouts.ledger import MemoryLedger
from services.rollouts.settings import RolloutSettings
from tests.support.records import NOW, judged_trace, verdict_for


class Bus:
    def __init__(self) -> None:
        self.published: list[RolloutGroup] = []

    async def publish(self, spec, message) -> None:
        self.published.append(message)


class Runner:
    """Fails with ``error`` for the tasks named in ``failing``; otherwise returns a stand-in group."""

    def __init__(self, failing: dict[str, Exception]) -> None:
        self.failing, self.ran = failing, []
        self.metrics = type("M", (), {"groups": _Count(), "failed": _Count()})()

    async def run_group(self, task, group_id=None):
        self.ran.append(task.task_id)
        if task.task_id in self.failing:
            raise self.failing[task.task_id]
        return type("G", (), {"group_id": "g", "model_id": "router", "adapter_version": 1})()


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


@pytest.fixture
def tasks():
    return [build_task(judged_trace(f"t-{i}"), verdict_for(f"t-{i}"), now=NOW) for i in range(3)]


async def test_the_ledger_keeps_a_task_until_its_group_is_out(tasks, monkeypatch):
    monkeypatch.setattr(worker_mod, "GROUP_ATTEMPTS", 1)
    ok, flaky, broken = tasks
    ledger = MemoryLedger()
    runner = Runner({flaky.task_id: TransientError("relay down"), broken.task_id: ValueError("a broken task")})
    w = worker_mod.RolloutWorker(RolloutSettings(admin_token="x"), Bus(), runner, ledger)  # type: ignore[arg-type]
    try:
        for i, t in enumerate(tasks):
            await w.on_task(t, RecordRef("tasks", 0, i))
        assert [t.task_id for _, t in await ledger.pending()] == [t.task_id for t in tasks]  # before any group ran
        await w.queue.join()
    finally:
        await w.close()
    assert sorted(runner.ran) == sorted(t.task_id for t in tasks)
    assert [t.task_id for _, t in await ledger.pending()] == [flaky.task_id]  # retried at the next start
    assert (w.published, runner.metrics.failed.n) == (1, 2)


async def test_a_restart_runs_every_group_the_last_run_left(tasks):
    ledger = MemoryLedger()
    for i, t in enumerate(tasks):
        assert await ledger.accept(RecordRef("tasks", 0, i).key, t)
    runner = Runner({})
    bus = Bus()
    w = worker_mod.RolloutWorker(RolloutSettings(admin_token="x"), bus, runner, ledger)  # type: ignore[arg-type]
    try:
        await w.resume(await ledger.pending())
        await w.queue.join()
    finally:
        await w.close()
    assert set(runner.ran) == {t.task_id for t in tasks} and len(bus.published) == 3
    assert await ledger.pending() == []


async def test_a_redelivered_record_is_not_run_again_but_the_same_task_sent_again_is():
    (task,) = [build_task(judged_trace("t-0"), verdict_for("t-0"), now=NOW)]
    ledger, runner, bus = MemoryLedger(), Runner({}), Bus()
    w = worker_mod.RolloutWorker(RolloutSettings(admin_token="x"), bus, runner, ledger)  # type: ignore[arg-type]
    try:
        await w.on_task(task, RecordRef("tasks", 0, 7))
        await w.queue.join()
        await w.on_task(task, RecordRef("tasks", 0, 7))  # redelivered: its group is out already
        await w.on_task(task, RecordRef("tasks", 0, 9))  # sent again (a requeue): another group
        await w.queue.join()
    finally:
        await w.close()
    assert len(runner.ran) == 2 and len(bus.published) == 2 and await ledger.pending() == []
    assert RecordRef("tasks", 0, 7).key < RecordRef("tasks", 0, 10).key  # zero-padded: log order


async def test_a_record_run_again_after_a_lost_mark_gives_the_same_group_id():
    """Killed between publishing and marking done: the restart runs the record again, under the same group
    id (derived from the record), so the trainer can drop the second group."""
    (task,) = [build_task(judged_trace("t-0"), verdict_for("t-0"), now=NOW)]

    class Ids(Runner):
        async def run_group(self, task, group_id=None):
            self.ran.append(group_id)
            return type("G", (), {"group_id": group_id, "model_id": "router", "adapter_version": 1})()

    class LostMark(MemoryLedger):
        async def done(self, key: str) -> None:  # the process died before this landed
            raise TransientError("killed")

    ledger, bus = LostMark(), Bus()
    first = worker_mod.RolloutWorker(RolloutSettings(admin_token="x"), bus, Ids({}), ledger)  # type: ignore[arg-type]
    try:
        await first.on_task(task, RecordRef("tasks", 0, 3))
        await first.queue.join()
    finally:
        await first.close()
    runner = Ids({})
    again = worker_mod.RolloutWorker(RolloutSettings(admin_token="x"), bus, runner, MemoryLedger())  # type: ignore[arg-type]
    try:
        await again.resume(await ledger.pending())
        await again.queue.join()
    finally:
        await again.close()
    ids = [g.group_id for g in bus.published]
    assert len(ids) == 2 and ids[0] == ids[1] == worker_mod.group_id_of(RecordRef("tasks", 0, 3).key)
