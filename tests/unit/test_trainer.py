"""The trainer on a tiny random Llama: examples and masks, batching, the one-pass rule, the gate,
dry runs, checkpoint/resume equivalence, learning, held-out evaluation and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common.dataset import write_jsonl
from services.common.errors import ConfigError
from services.common.prompt import judge_key_of, providers_of
from services.trainer.data import (
    IGNORE,
    UncalibratedError,
    batch_order,
    build_example,
    build_examples,
    load_episodes_file,
    padding_stats,
    split_by_query,
)
from services.trainer.evaluate import score, tier_grades
from services.trainer.settings import TrainerSettings
from services.trainer.train import plan_run, train
from tests.support.trainer_runs import (  # noqa: F401  (fixtures by name)
    JUDGE, PROVIDERS, adapter_weights, episode, gate, lines, make_settings, tiny, tokenizer)


# ----------------------------------------------------------------------------- examples and batches


def test_loss_mask_covers_exactly_the_assistant_turn(tokenizer) -> None:
    ep = episode(1, answer="beta > alpha = gamma")
    ex = build_example(tokenizer, ep, max_tokens=4096)
    target = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]
    assert [lab for lab in ex.labels if lab != IGNORE] == target
    assert tokenizer.decode(target, skip_special_tokens=True) == "beta > alpha = gamma"
    assert target[-1] == tokenizer.eos_token_id  # the model learns to stop
    first = next(i for i, lab in enumerate(ex.labels) if lab != IGNORE)
    assert tokenizer.decode(ex.input_ids[:first]).endswith("<|im_start|>assistant\n")
    assert all(lab == IGNORE for lab in ex.labels[first + len(target):])  # ChatML's trailing newline
    assert not ex.truncated


def test_truncation_is_counted_and_targetless_examples_dropped(tokenizer) -> None:
    eps = [episode(i) for i in range(3)]
    full = len(build_example(tokenizer, eps[0], 4096).input_ids)
    cut = build_example(tokenizer, eps[0], full - 2)
    assert cut.truncated and len(cut.input_ids) == full - 2 and cut.n_target > 0
    built = build_examples(tokenizer, eps, max_tokens=40)  # cuts inside the system turn
    assert built.examples == [] and built.counts["truncated"] == 3
    assert built.counts["dropped/no_target_after_truncation"] == 3


def test_length_bucketing_covers_one_pass_and_pads_little() -> None:
    import random

    lengths = [random.Random(i).randint(20, 400) for i in range(101)]
    batches = batch_order(lengths, batch_size=4, window=8, seed=0)
    assert len(batches) == 26 and sorted(i for b in batches for i in b) == list(range(101))

    class E:
        def __init__(self, n: int) -> None:
            self.input_ids = [0] * n
    examples = [E(n) for n in lengths]
    bucketed = padding_stats(examples, batches)["nonpad_fraction"]
    shuffled = padding_stats(examples, batch_order(lengths, 4, 1, seed=0))["nonpad_fraction"]
    assert bucketed > 0.85 and shuffled < 0.75
    assert batch_order(lengths, 4, 8, seed=0) == batches  # reproducible from the seed


def test_split_is_by_query_not_by_episode() -> None:
    eps = [episode(i, query=f"query number {i % 10}") for i in range(40)]
    train_eps, held = split_by_query(eps, 0.3)
    assert held and train_eps
    assert not {e.messages[1].content for e in train_eps} & {e.messages[1].content for e in held}


def test_episodes_are_ordered_by_what_they_say_not_by_their_ids() -> None:
    """An episode's id comes from its trace's random id: the same judged traffic twice must split and
    order the same, or the seeded batches (and the adapter) differ from run to run."""
    eps = [episode(i, query=f"query number {i}") for i in range(20)]
    renamed = [e.model_copy(update={"episode_id": f"z{i:02d}"}) for i, e in enumerate(reversed(eps))]
    said = lambda split: [[m.content for m in e.messages] for e in split]  # noqa: E731
    for mine, theirs in zip(split_by_query(eps, 0.3), split_by_query(renamed, 0.3), strict=True):
        assert said(mine) == said(theirs)


def test_the_same_traffic_under_other_ids_trains_on_the_same_batches(make_settings) -> None:
    eps = [episode(i, query=f"query number {i}") for i in range(24)]
    renamed = [e.model_copy(update={"episode_id": f"z{i:02d}"}) for i, e in enumerate(reversed(eps))]
    plans = [plan_run(make_settings(x)) for x in (eps, renamed)]
    batches = [[[p.examples[i].input_ids for i in batch] for batch in p.batches] for p in plans]
    assert batches[0] == batches[1] and len(batches[0]) > 1


def test_judge_key_and_providers_come_from_the_episode() -> None:
    key = judge_key_of("ndcg:openai:gpt-4o:abcd1234")
    assert (key.judge_model, key.rubric_prefix) == ("openai:gpt-4o", "abcd1234")
    assert judge_key_of("csat") is None
    assert providers_of(episode(0)) == PROVIDERS


# ----------------------------------------------------------------------------- the rules of a run


def test_one_pass_rule_stops_and_says_so(make_settings, capsys) -> None:
    s = make_settings([episode(i) for i in range(5)], max_steps=100)
    result = train(s)
    assert result.steps == 3
    out = capsys.readouterr().out
    assert "one pass over 5 training episodes at 2 per batch is 3 steps; stopping after 3" in out
    recs = lines(s.output_dir / "metrics.jsonl")
    assert recs[0]["one_pass"] == {"steps_asked": 100, "steps_per_pass": 3, "steps": 3, "capped": True,
                                   "message": recs[0]["one_pass"]["message"]}
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "nonpad_fraction", "epoch"} <= steps[0].keys()
    assert steps[-1]["epoch"] == 1.0 and recs[-1]["one_pass_capped"] is True


def test_no_gate_is_refused_with_a_clear_error(make_settings) -> None:
    eps = [episode(i) for i in range(4)]
    with pytest.raises(UncalibratedError, match=r"no open calibration gate.*--allow-uncalibrated") as err:
        train(make_settings(eps, allow_uncalibrated=False), gate_lookup=lambda key, providers: None)
    assert f"{JUDGE} on [alpha, beta, gamma]: gate missing, 4 episodes" in str(err.value)
    with pytest.raises(UncalibratedError, match=r"gate closed \(tau-b 0.5 vs 0.7\)"):
        plan_run(make_settings(eps, allow_uncalibrated=False), gate_lookup=lambda key, providers: gate(False))
    asked = []
    plan = plan_run(make_settings(eps, allow_uncalibrated=False),
                    gate_lookup=lambda key, providers: asked.append((key, providers)) or gate(True))
    assert [g.status for g in plan.gates] == ["open"] and plan.uncalibrated_episodes == 0
    assert asked == [(judge_key_of(JUDGE), PROVIDERS)]


def test_allow_uncalibrated_trains_and_records_it(make_settings, capsys) -> None:
    s = make_settings([episode(i) for i in range(4)], allow_uncalibrated=True)
    result = train(s, gate_lookup=lambda key, providers: None)
    assert result.trained and result.steps == 2
    config = json.loads((s.output_dir / "config.json").read_text())
    assert config["allow_uncalibrated"] is True and config["uncalibrated_episodes"] == 4
    assert config["gates"][0]["status"] == "missing"
    assert lines(s.output_dir / "metrics.jsonl")[-1]["allow_uncalibrated"] is True
    assert "allow_uncalibrated: training on 4 episodes without an open gate" in capsys.readouterr().out


def test_dry_run_prints_config_and_counts_and_trains_nothing(make_settings, capsys) -> None:
    s = make_settings([episode(i) for i in range(5)], dry_run=True, max_steps=100)
    result = train(s)
    out = capsys.readouterr().out
    assert not result.trained and not s.output_dir.exists()
    printed = json.loads(out[:out.rindex("}") + 1])
    assert printed["config"]["batch_size"] == 2 and printed["data"]["selected"] == 5
    assert printed["data"]["examples"] == 5 and 0 < printed["data"]["nonpad_fraction"] <= 1
    assert "dry run: one pass over 5 training episodes" in out and "nothing trained" in out


def test_cli_dry_run_and_invalid_settings(make_settings, capsys) -> None:
    from services.trainer.cli import add_parser, run

    s = make_settings([episode(i) for i in range(3)])
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["train", "--base-model", s.base_model, "--episodes-file", str(s.episodes_file),
                              "--allow-uncalibrated", "--dry-run", "--lora-r", "4", "--output-dir",
                              str(s.output_dir)])
    assert run(args) == 0
    assert '"r": 4' in capsys.readouterr().out
    assert run(parser.parse_args(["train", "--batch-size", "0"])) == 2
    assert "batch_size" in capsys.readouterr().err
    assert run(parser.parse_args(["train", "--tie-smoothing", "2"])) == 2  # bounded, named
    assert "tie_smoothing" in capsys.readouterr().err
    assert run(parser.parse_args(["train", "--tie-smoothing", "0.3", "--target", "ordering"])) == 2
    assert "applies to target first only" in capsys.readouterr().err


# ----------------------------------------------------------------------------- checkpoints and learning


def test_resume_continues_exactly(make_settings, tmp_path: Path) -> None:
    import torch

    eps = [episode(i) for i in range(8)]
    whole = train(make_settings(eps, max_steps=4, output_dir=tmp_path / "whole"))
    first = train(make_settings(eps, max_steps=2, output_dir=tmp_path / "split"))
    assert (first.steps, whole.steps) == (2, 4)
    second = train(make_settings(eps, max_steps=4, output_dir=tmp_path / "split", resume=True))
    assert second.steps == 4
    a, b = adapter_weights(tmp_path / "whole"), adapter_weights(tmp_path / "split")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    assert not torch.equal(a[next(k for k in a if "lora_B" in k)], torch.zeros(1))  # it did train
    split_steps = [r["step"] for r in lines(tmp_path / "split" / "metrics.jsonl") if "loss" in r]
    assert split_steps == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="pass --resume"):
        train(make_settings(eps, output_dir=tmp_path / "split"))
    with pytest.raises(ConfigError, match=r"settings changed \(lr: 0.01 -> 0.02\)"):
        train(make_settings(eps, output_dir=tmp_path / "split", resume=True, lr=2e-2))


def test_loss_falls_on_a_repeated_example(make_settings) -> None:
    eps = [episode(i, query="protein heart", answer="gamma > beta > alpha") for i in range(16)]
    result = train(make_settings(eps, batch_size=2, lr=3e-2, lora={"dropout": 0.0}))
    losses = [r["loss"] for r in lines(result.output_dir / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 8
    assert losses[-1] < 0.8 * losses[0]
    assert all(b < a for a, b in zip(losses[1:], losses[2:]))  # steadily, after the first step


def test_eval_is_logged_under_test_and_published(make_settings, tmp_path: Path) -> None:
    eps = [episode(i, query=f"query {i}") for i in range(24)]
    published = []

    class FakePublisher:
        def publish(self, model_id: str, adapter_dir: Path, base_model: str, metrics: dict) -> dict:
            published.append((model_id, adapter_dir, base_model, metrics))
            assert (adapter_dir / "adapter_config.json").is_file()
            return {"version": 1}

    grades = {f"tr{i:04d}": {"alpha": 3.0, "beta": 1.0, "gamma": 0.0} for i in range(0, 24, 2)}
    s = make_settings(eps, eval_fraction=0.4, eval_every=2, eval_max_new_tokens=8, model_id="router-test")
    result = train(s, grades_for=grades.get, publisher=FakePublisher())
    evals = [r for r in lines(s.output_dir / "metrics.jsonl") if "test/ndcg" in r and "event" not in r]
    assert [r["step"] for r in evals] == list(range(2, result.steps, 2)) + [result.steps]
    held = result.plan.counts["eval_episodes"]
    assert held > 0 and evals[-1]["test/n"] == held
    assert 0 <= evals[-1]["test/ndcg"] <= 1 and 0 <= evals[-1]["test/top1"] <= 1
    assert 0 < evals[-1]["test/grades_from_verdicts"] < 1  # some traces have verdict grades, others fall back
    (model_id, adapter_dir, base, metrics), = published
    assert (model_id, adapter_dir, base) == ("router-test", s.output_dir / "adapter", s.base_model)
    assert metrics["steps"] == result.steps and "test/ndcg" in metrics
    assert json.loads((s.output_dir / "summary.json").read_text())["published"] == {"version": 1}
    # A later run can start from the published adapter.
    again = train(make_settings(eps[:4], output_dir=tmp_path / "next", init_adapter=adapter_dir))
    assert again.trained and again.steps == 2


def test_scoring_is_tolerant() -> None:
    grades = {"alpha": 3.0, "beta": 1.0, "gamma": 0.0}
    assert score("alpha > beta > gamma", grades) == (1.0, 1.0)
    assert score("zeta > omega", grades) == (0.0, 0.0)  # unknown names gain nothing
    assert score("", grades) == (0.0, 0.0) and score("alpha > > beta", grades) == (0.0, 0.0)
    assert score("gamma > alpha\nmore text", grades)[1] == 0.0
    assert tier_grades((("a", "b"), ("c",))) == {"a": 2.0, "b": 2.0, "c": 1.0}


# ----------------------------------------------------------------------------- bad input


def test_malformed_episodes_line_is_named(tmp_path: Path) -> None:
    path = write_jsonl([episode(0)], tmp_path / "eps.jsonl")
    path.write_text(path.read_text() + '{"schema_version": 1, "episode_id": "x"}\n')
    with pytest.raises(ConfigError, match=r"eps.jsonl:2: not an episode"):
        load_episodes_file(path)
    path.write_text(path.read_text().splitlines()[0] + "\nnot json\n")
    with pytest.raises(ConfigError, match=r"eps.jsonl:2: .*not valid JSON"):
        load_episodes_file(path)


def test_reward_window_that_selects_nothing(make_settings) -> None:
    eps = [episode(i, reward=0.2 + 0.1 * i) for i in range(4)]
    with pytest.raises(ConfigError, match=r"reward window \[0.9, None\] on first ndcg:\* reward selects none of "
                                          r"4 episodes \(below_min 4\)"):
        train(make_settings(eps, run={"reward_min": 0.9}))
    with pytest.raises(ConfigError, match=r"on csat selects none of 4 episodes \(no_reward 4\)"):
        train(make_settings(eps, run={"type": "sft", "reward_name": "csat"}))
    plan = plan_run(make_settings(eps, run={"reward_min": 0.3, "reward_max": 0.45}))
    assert plan.counts["selected"] == 2 and plan.counts["dropped/below_min"] == 1


def test_run_kind_is_a_discriminated_union() -> None:
    from pydantic import ValidationError

    assert TrainerSettings(run={"reward_min": 0.1}).run.type == "sft"
    assert {TrainerSettings(run={"type": kind}).run.type for kind in ("sft", "opsd", "rl")} == {"sft", "opsd", "rl"}
    with pytest.raises(ValidationError, match="dpo"):
        TrainerSettings(run={"type": "dpo"})  # not a run kind
    with pytest.raises(ValidationError, match="reward_min"):
        TrainerSettings(run={"reward_min": 0.9, "reward_max": 0.1})


def test_periodic_saves_and_evals_follow_their_intervals_and_the_end_saves_once() -> None:
    from services.trainer import checkpoint as ckpt

    calls: list[tuple[str, int]] = []

    def save(step: int) -> None:
        calls.append(("save", step))

    def evaluate(step: int) -> None:
        calls.append(("eval", step))

    for step in range(1, 7):
        ckpt.after_step(step, 6, 2, 3, save, evaluate)
    ckpt.at_end(0, 6, save, evaluate)
    assert calls == [("save", 2), ("eval", 3), ("save", 4), ("save", 6), ("eval", 6)]
    calls.clear()
    ckpt.at_end(6, 6, save, evaluate)  # resumed at its last step: nothing new to save, the eval still runs
    assert calls == [("eval", 6)]
