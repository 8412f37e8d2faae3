"""The trainer's runs from outside: publishing (lazily built client, the real publisher client), the
Kafka gate lookup, the default reward, a diverged loss, a re-tied output layer, micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.calibration import CalibrationRecord
from services.common.prompt import judge_key_of
from services.trainer.train import train
from tests.support import records
from tests.support.trainer_runs import (  # noqa: F401  (fixtures by name)
    JUDGE, PROVIDERS, WORDS, episode, gate, lines, make_settings, tiny)


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
