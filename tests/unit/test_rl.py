"""Run kind rl without a broker: settings refused clearly, the feeder's order and claims, staleness triage,
packing of datums into rows, reward figures."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from pydantic import ValidationError

from services.common.errors import ConfigError
from services.episodes.tasks import build_task, write_task
from services.trainer.cli import main as trainer_main
from services.trainer.rl import plan_rl, train_rl
from services.trainer.rl_data import (
    Feeder,
    bucket,
    load_tasks,
    pack,
    reward_stats,
    split_tasks,
    triage,
)
from services.trainer.settings import TrainerSettings
from tests.support.records import NOW, judged_trace, verdict_for
from tests.support.rl_groups import group


@pytest.fixture
def tasks():
    return [build_task(judged_trace(f"t{i}"), verdict_for(f"t{i}"), now=NOW) for i in range(4)]


@pytest.mark.parametrize("run, needle", [
    ({"type": "rl", "groups_per_batch": 0}, "groups_per_batch"),
    ({"type": "rl", "max_steps_off_policy": -1}, "max_steps_off_policy"),
    ({"type": "rl", "loss": "reinforce"}, "loss"),
    ({"type": "rl", "hint_mode": "reward"}, "hint_mode"),  # another kind's knob
    ({"type": "rl", "resample_uniform": -1}, "resample_uniform"),
    ({"type": "rl", "micro_batch_rows": 0}, "micro_batch_rows"),
])
def test_bad_rl_settings_name_the_field(run, needle):
    with pytest.raises(ValidationError, match=needle):
        TrainerSettings(run=run)


@pytest.mark.parametrize("flag, value, field", [("--groups-per-batch", "0", "groups_per_batch"),
                                                ("--micro-batch-rows", "0", "micro_batch_rows"),
                                                ("--resample-uniform", "-1", "resample_uniform")])
def test_the_cli_refuses_bad_rl_settings_with_exit_2(capsys, flag, value, field):
    assert trainer_main(["--kind", "rl", flag, value]) == 2
    assert field in capsys.readouterr().err


def test_rl_without_tasks_or_a_publisher_is_a_config_error(tasks, tmp_path):
    from tests.support.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "base")
    with pytest.raises(ConfigError, match="tasks_dir"):
        plan_rl(TrainerSettings(base_model=str(base), run={"type": "rl"}), None)
    with pytest.raises(ConfigError, match="is not a directory"):
        plan_rl(TrainerSettings(base_model=str(base), run={"type": "rl", "tasks_dir": tmp_path / "none"}), None)
    with pytest.raises(ConfigError, match="publisher_url"):
        train_rl(TrainerSettings(base_model=str(base), output_dir=tmp_path / "run", run={"type": "rl"}), tasks=tasks)


def test_tasks_load_from_a_directory_checked_and_filtered(tasks, tmp_path):
    for t in tasks:
        write_task(t, tmp_path / "tasks")
    loaded = load_tasks(tmp_path / "tasks", contested_only=True, limit=3)
    assert [t.task_id for t in loaded] == sorted(t.task_id for t in tasks)[:3]
    assert loaded[0].files == next(t for t in tasks if t.task_id == loaded[0].task_id).files
    (tmp_path / "tasks" / loaded[0].task_id / "instruction.md").write_text("edited")
    with pytest.raises(ConfigError, match="hash"):
        load_tasks(tmp_path / "tasks")
    train, held = split_tasks(tasks, 0.5)
    assert sorted(train + held, key=lambda t: t.task_id) == sorted(tasks, key=lambda t: t.task_id)
    with pytest.raises(ConfigError, match="holds out every"):
        split_tasks(tasks, 1.0)


def test_every_epoch_feeds_the_whole_set_and_claims_need_a_request(tasks):
    f = Feeder("router", tasks, seed=1)
    first, second = f.next_tasks(4), f.next_tasks(4)
    assert {t.task_id for t in first} == {t.task_id for t in second} == {t.task_id for t in tasks}
    g = group(tasks[0], [1.0, 0.0], version=1)
    assert f.claim(g) is None  # never sent: someone else's group
    f.sent(tasks[0], at=g.started_at + timedelta(seconds=1))
    assert f.claim(g) is None  # started before this run asked for it
    f.sent(tasks[0], "eval", at=g.started_at - timedelta(seconds=1))
    assert f.claim(group(tasks[0], [1.0], version=1, model_id="other")) is None
    assert f.claim(g) == "eval" and f.in_flight == 1


def test_a_group_more_than_max_steps_off_policy_behind_is_stale(tasks):
    step_of = {3: 0, 4: 1, 5: 2}
    g = group(tasks[0], [1.0, 0.0], version=4)
    assert triage(g, 2, step_of, 1) == "fresh" and triage(g, 3, step_of, 1) == "stale"
    assert triage(g, 1, step_of, 0) == "fresh" and triage(g, 2, step_of, 0) == "stale"
    assert triage(group(tasks[0], [1.0], version=2), 0, step_of, 100) == "stale"  # from before the run


def test_packing_keeps_sampled_positions_and_skips_uniform_groups(tasks):
    g, u = group(tasks[0], [1.0, 0.0], version=1), group(tasks[1], [0.5, 0.5], version=1)
    rows = pack([g, u], max_tokens=64)
    assert len(rows.sequences) == 2 and rows.starts == [10, 10]
    assert rows.weights[0] == [1.0] * 4 and rows.advantages == [[0.5] * 4, [-0.5] * 4]
    assert rows.logprobs[0] == [-1.5] * 4
    cut = pack([g], max_tokens=12)
    assert cut.truncated == 2 and cut.weights[0] == [1.0, 1.0]
    assert pack([g], max_tokens=10).dropped == 2
    assert (bucket(13, 32, 512), bucket(40, 32, 512), bucket(600, 32, 512)) == (32, 64, 600)


def test_reward_figures():
    stats = reward_stats([group(build_task(judged_trace("a"), verdict_for("a"), now=NOW), [0.0, 1.0, 0.5, 0.5],
                                version=1)])
    assert stats["reward/mean"] == 0.5 and stats["reward/min"] == 0.0 and stats["reward/max"] == 1.0
    assert stats["reward/zero_share"] == 0.25 and math.isclose(stats["reward/std"], math.sqrt(0.125))


def test_a_recipe_summary_plots_its_reward_and_mismatch(tmp_path):
    from services.tools.rl_recipes import plot_steps

    summary = {"recipe": "overfit", "steps": [
        {"step": i, "reward/mean": r, "reward/p50": r, "mismatch": 1e-6} for i, r in enumerate((0.7, 0.8, 0.9), 1)]
        + [{"step": 4, "reward/mean": 0.9, "reward/p50": 0.9, "skipped": True}]}  # uniform: no mismatch
    path = plot_steps(summary, tmp_path / "overfit.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_published_twice_under_one_id_is_claimed_once(tasks):
    """A runner killed after publishing a group and before marking it done runs the record again on restart;
    both groups carry the record's group id (``services.rollouts.worker.group_id_of``): the second is
    dropped, and it does not answer a later request for the same task (a resample, a requeue)."""
    f = Feeder("router", tasks, seed=1)
    g = group(tasks[0], [1.0, 0.0], version=1)
    f.sent(tasks[0], at=g.started_at - timedelta(seconds=2))
    f.sent(tasks[0], at=g.started_at - timedelta(seconds=1))  # asked again (e.g. dynamic sampling)
    assert f.claim(g) == "train"
    assert f.claim(g.model_copy()) == "duplicate" and f.in_flight == 1  # the second request still waits


def test_held_out_tasks_given_apart_are_the_eval_and_may_not_share_a_query(tasks, tmp_path):
    from services.trainer.rl_data import task_query
    from tests.support.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "base")
    other = judged_trace("h1").model_copy(update={"query": "Lunar  REGOLITH thermal conductivity"})
    held = [build_task(other, verdict_for("h1"), now=NOW)]
    assert task_query(held[0]) == "lunar regolith thermal conductivity"
    for t in held:
        write_task(t, tmp_path / "held")
    s = TrainerSettings(base_model=str(base), eval_fraction=0.5,
                        run={"type": "rl", "eval_tasks_dir": tmp_path / "held"})
    plan = plan_rl(s, tasks)
    assert plan.counts["train_tasks"] == 4 and plan.counts["eval_tasks"] == 1  # eval_fraction is not read
    assert plan.examples[-1].task_id == held[0].task_id
    same_query = [build_task(judged_trace("h2"), verdict_for("h2"), now=NOW)]  # the training tasks' query
    with pytest.raises(ConfigError, match="share a trace or query"):
        plan_rl(s, tasks, same_query)
    with pytest.raises(ConfigError, match="share a trace or query"):
        plan_rl(s, tasks, tasks[:1])
