"""The trainer on a tiny random Llama: examples and masks, batching, the one-pass rule, the gate,
dry runs, checkpoint/resume equivalence, learning, held-out evaluation and bad input."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.calibration import CalibrationRecord
from schemas.episode import Episode, RewardComponent
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
from tests.support import records
from tests.support.tiny_model import build_tiny_model

PROVIDERS = ("alpha", "beta", "gamma")
JUDGE = "ndcg:local-lexical-v1:d8001873"
ORDERINGS = ("alpha > beta = gamma", "beta > alpha > gamma", "gamma = alpha > beta")
WORDS = "protein heart mouse cells effect study search query model".split()


def episode(i: int, *, query: str | None = None, answer: str | None = None, reward: float = 1.0,
            reward_name: str = JUDGE) -> Episode:
    """A routing episode over PROVIDERS with one ndcg reward component."""
    return records.episode(query or f"{WORDS[i % len(WORDS)]} {WORDS[(i * 3 + 1) % 9]} {i}",
                           answer or ORDERINGS[i % len(ORDERINGS)], PROVIDERS, f"ep{i:04d}", trace_id=f"tr{i:04d}",
                           created_at=datetime(2026, 1, 1, tzinfo=UTC),
                           rewards=[RewardComponent(component_id=f"c{i}", name=reward_name, value=reward)])


def gate(open_: bool) -> CalibrationRecord:
    return CalibrationRecord(gate_key="k" * 24, created_at=datetime(2026, 1, 1, tzinfo=UTC), judge_kind="local",
                             judge_model="local-lexical-v1", rubric_hash="d8001873" + "0" * 56,
                             providers=PROVIDERS, human_source="qrels", tau_b=0.8 if open_ else 0.5, top1=0.9,
                             n=100, threshold=0.7, open=open_)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture
def make_settings(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Settings for an offline run on the tiny model; episodes written to a file."""
    for var in list(__import__("os").environ):
        if var.startswith("FANROUTE_"):
            monkeypatch.delenv(var)

    def make(episodes: list[Episode], **kw) -> TrainerSettings:
        path = write_jsonl(episodes, tmp_path / "episodes.jsonl")
        base = dict(base_model=str(tiny), episodes_file=path, output_dir=tmp_path / "run", eval_fraction=0.0,
                    eval_every=0, checkpoint_every=0, batch_size=2, lr=1e-2, allow_uncalibrated=True)
        return TrainerSettings(**(base | kw))
    return make


def open_gate(key, providers):
    return gate(True)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


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


# ----------------------------------------------------------------------------- checkpoints and learning


def adapter_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


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


# ----------------------------------------------------------------------------- publishing and Kafka lookups


def test_publisher_url_builds_the_client_lazily_and_failures_are_reported(make_settings, monkeypatch) -> None:
    import sys
    import types

    from services.trainer.train import PublishError

    calls = []

    class PublisherClient:
        def __init__(self, base_url: str) -> None:
            self.base_url = base_url

        def publish(self, model_id: str, adapter_dir: Path, base_model: str, metrics: dict) -> dict:
            calls.append((self.base_url, model_id))
            raise ConnectionError("publisher down")

    client = types.ModuleType("services.common.publisher_client")
    client.PublisherClient = PublisherClient
    monkeypatch.setitem(sys.modules, "services.publisher", types.ModuleType("services.publisher"))
    monkeypatch.setitem(sys.modules, "services.common.publisher_client", client)
    s = make_settings([episode(i) for i in range(2)], publisher_url="http://publisher:8080")
    with pytest.raises(PublishError, match="but publishing run failed: publisher down"):
        train(s)
    assert calls == [("http://publisher:8080", "run")]
    summary = json.loads((s.output_dir / "summary.json").read_text())
    assert summary["published"] == {"error": "ConnectionError: publisher down"}
    assert (s.output_dir / "adapter" / "adapter_model.safetensors").is_file()


async def test_kafka_gate_lookup_matches_model_rubric_prefix_and_providers(monkeypatch) -> None:
    from schemas.calibration import CalibrationRecord, gate_key
    from services.common import replay_topic
    from services.common.settings import KafkaSettings
    from services.trainer.data import kafka_gate_lookup

    full = "d8001873" + "0" * 56
    records = [gate(True).model_copy(update={"gate_key": gate_key("local", "local-lexical-v1", full, PROVIDERS)}),
               gate(True).model_copy(update={"judge_model": "other", "gate_key": "x" * 24})]

    async def read_topic(kafka, spec, *, model):
        assert spec.name == "calibrations" and model is CalibrationRecord
        for r in records:
            yield r

    monkeypatch.setattr(replay_topic, "read_topic", read_topic)
    key = judge_key_of(JUDGE)
    lookup = await kafka_gate_lookup(KafkaSettings(), [(key, PROVIDERS), (key, ("alpha", "beta"))])
    assert lookup(key, PROVIDERS) == records[0]
    assert lookup(key, ("alpha", "beta")) is None  # another provider set is another gate


def test_trainer_publishes_through_the_real_publisher_client(make_settings, tmp_path: Path) -> None:
    """The interface contract end to end: our adapter directory and metrics are what the publisher accepts."""
    from tests.unit.test_publisher import Harness

    h = Harness(tmp_path / "publisher")
    with h.http:
        s = make_settings([episode(i) for i in range(3)], model_id="router-tiny")
        result = train(s, publisher=h.client)
    assert result.published["model_id"] == "router-tiny" and result.published["version"] == 1
    manifest = h.client.manifest("router-tiny", 1)
    assert manifest["base_model"] == s.base_model and manifest["metrics"]["steps"] == 2.0
    # the top-tier table the gateway decides with travels with the adapter, counted from the training split
    from services.common.adapter_files import RATES_FILE
    from services.router.rates import from_json

    assert RATES_FILE in manifest["files_sha256"]
    doc = json.loads(h.client.fetch_file(manifest, RATES_FILE))
    assert doc["episodes"] == len(result.plan.train_episodes) and from_json(doc) == result.plan.rates != {}


def test_default_reward_is_the_primary_one_not_the_first_by_name():
    from services.episodes.build import build_episode, ndcg_component
    from services.trainer.data import episode_judge, reward_of
    from tests.support.records import judged_trace, verdict_for

    t = judged_trace("p1")
    first = verdict_for("p1", model="zeta-judge")
    later = verdict_for("p1", model="alpha-judge", rubric="rubric-2")
    ep = build_episode(t, first)
    ep = build_episode(t, first, list(ep.rewards) + [ndcg_component(ep.episode_id, later, first.ordering)])
    assert [c.name for c in ep.rewards][0].startswith("ndcg:alpha-judge")  # sorts first...
    assert reward_of(ep, None).name == "ndcg:zeta-judge:rubric-1"  # ...but the primary one is chosen
    assert episode_judge(ep, None).judge_model == "zeta-judge"


def test_a_loss_that_is_not_finite_stops_the_run_before_saving(make_settings, monkeypatch) -> None:
    import services.trainer.train as train_mod

    real_step = train_mod._train_step

    def nan_on_second(*args, **kwargs):
        rec = real_step(*args, **kwargs)
        nan_on_second.calls += 1
        return {**rec, "grad_norm": float("inf")} if nan_on_second.calls == 2 else rec

    nan_on_second.calls = 0
    monkeypatch.setattr(train_mod, "_train_step", nan_on_second)
    settings = make_settings([episode(i) for i in range(8)], max_steps=4)
    with pytest.raises(train_mod.DivergedError, match="step 2"):
        train_mod.train(settings)
    assert not (settings.output_dir / "adapter").exists()


def test_an_untied_output_layer_is_tied_again_on_load(tiny: Path) -> None:
    import torch

    from services.models.load import ensure_tied, load_causal_lm

    model = load_causal_lm(tiny, torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.get_output_embeddings().weight = torch.nn.Parameter(torch.zeros_like(model.get_input_embeddings().weight))
    assert ensure_tied(model) is True
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ensure_tied(model) is False


@pytest.mark.parametrize("balance", [0.0, 1.0])
def test_micro_batches_give_the_same_steps_as_whole_batches(make_settings, tmp_path: Path, balance: float) -> None:
    """Split into parts of one example each, a batch's gradient is the whole batch's (so is its loss);
    with class-balancing weights too (a part whose weights are all 1 still counts against its batch)."""
    import torch
    from safetensors.torch import load_file

    from services.trainer.data import micro_batches

    eps = [episode(i, query=f"{WORDS[i % 9]} and {'more ' * (i % 5)}words {i}") for i in range(12)]
    runs = {}
    for name, budget in (("whole", 0), ("parts", 1)):
        result = train(make_settings(eps, batch_size=4, lora={"dropout": 0.0}, micro_batch_tokens=budget,
                                     run={"type": "sft", "class_balance": balance},
                                     output_dir=tmp_path / name))
        runs[name] = (lines(result.output_dir / "metrics.jsonl"), load_file(result.adapter_dir / "adapter_model.safetensors"))
    (whole, w_weights), (parts, p_weights) = runs["whole"], runs["parts"]
    steps = [r for r in whole if "loss" in r]
    assert [r["micro_batches"] for r in steps] == [1] * len(steps)
    assert [r["micro_batches"] for r in parts if "loss" in r] == [4] * len(steps)
    for a, b in zip(steps, [r for r in parts if "loss" in r], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert all(torch.allclose(w_weights[k], p_weights[k], atol=1e-6) for k in w_weights)
    # the split itself: longest first, every part within the budget unless it is one example
    from services.trainer.data import Example

    exs = [Example(f"e{n}", (1,) * n, (1,) * n, False) for n in (3, 9, 5, 5, 2)]
    got = micro_batches(exs, 10)
    assert [[len(e.input_ids) for e in part] for part in got] == [[9], [5, 5], [3, 2]]
    assert micro_batches(exs, 0) == [exs]
