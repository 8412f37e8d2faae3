"""A training in its own process: settings → flags round trip, a real child on the tiny model, a failure named."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.common.dataset import write_jsonl
from services.common.settings import KafkaSettings, RedisSettings, connection_env
from services.trainer import launch
from services.trainer.settings import LoraSettings, OpsdRun, RlRun, TrainerSettings, add_arguments, settings_from_args
from tests.support.tiny_model import build_tiny_model
from tests.support.trainer_runs import episode


@pytest.fixture(autouse=True)
def _no_fanroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(__import__("os").environ):
        if var.startswith("FANROUTE_"):
            monkeypatch.delenv(var)


def reparsed(settings: TrainerSettings) -> TrainerSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(launch.to_argv(settings)))


@pytest.mark.parametrize("run", [None, OpsdRun(teacher="live", anchor_coef=0.25, protect_eot=False),
                                 RlRun(tasks_dir=Path("/t"), groups_per_batch=4, contested_only=True, micro_batch_rows=8)])
def test_flags_rebuild_every_setting_but_the_connections(run, tmp_path: Path) -> None:
    kw = dict(output_dir=tmp_path / "run", episodes_file=tmp_path / "e.jsonl", init_adapter=tmp_path / "a",
              as_of=datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC), allow_uncalibrated=True, max_steps=7, lr=3e-4,
              lr_schedule="cosine", seed=11, publisher_url="http://127.0.0.1:9", model_id="router",
              lora=LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")), eval_every=0, log_level="DEBUG",
              route_cost_weight=150.0, route_costs="aero=0.001,web-lexical=0.003")
    settings = TrainerSettings(**kw, **({"run": run} if run else {}))
    assert reparsed(settings).model_dump(exclude={"kafka", "redis"}) == settings.model_dump(exclude={"kafka", "redis"})
    assert reparsed(TrainerSettings()) == TrainerSettings()  # defaults give no flags at all
    assert launch.to_argv(TrainerSettings()) == ["--kind", "sft"]


def test_connections_travel_as_the_environment_the_child_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = TrainerSettings(kafka=KafkaSettings(bootstrap_servers="10.0.0.1:9093", topic_namespace="t1",
                                                 ensure_topics=False), redis=RedisSettings(url="redis://r:1/2"))
    for key, value in connection_env(parent).items():
        monkeypatch.setenv(key, value)
    child = TrainerSettings()
    assert child.kafka == parent.kafka and child.redis == parent.redis


def test_a_child_trains_on_the_tiny_model_and_its_summary_comes_back(tmp_path: Path, capsys) -> None:
    tiny = build_tiny_model(tmp_path / "tiny")
    data = write_jsonl([episode(i) for i in range(4)], tmp_path / "episodes.jsonl")
    settings = TrainerSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), base_model=str(tiny),
                               episodes_file=data, output_dir=tmp_path / "run", eval_fraction=0.0, eval_every=0,
                               checkpoint_every=0, batch_size=2, allow_uncalibrated=True, threads=1)
    summary = launch.train_in_process(settings)
    assert Path(summary["adapter_dir"]) == tmp_path / "run" / "adapter"
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file() and summary["published"] is None
    out = capsys.readouterr().out
    assert "done: 2 steps" in out  # the child's progress lines are forwarded as they come
    assert "services.trainer" in (tmp_path / "run" / "trainer.log").read_text()  # the command line heads its log


def test_a_failing_child_is_one_error_naming_its_exit_code_and_log(tmp_path: Path) -> None:
    settings = TrainerSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), base_model=str(tmp_path / "none"),
                               episodes_file=tmp_path / "missing.jsonl", output_dir=tmp_path / "run")
    with pytest.raises(launch.TrainerProcessError, match=r"exited 2: .*log: .*trainer\.log"):
        launch.train_in_process(settings)


def test_route_costs_are_read_as_a_table_and_a_malformed_one_names_the_field() -> None:
    from pydantic import ValidationError

    assert TrainerSettings(route_costs="aero=0.001,web-lexical=3e-3").route_cost_table == {
        "aero": 0.001, "web-lexical": 0.003}
    assert TrainerSettings().route_cost_table == {}
    with pytest.raises(ValidationError, match="route_costs"):
        TrainerSettings(route_costs="aero:0.001")
