"""The trainer tests' episodes over three providers, a gate record, the tiny model and its tokenizer, and
settings for an offline run: shared by the trainer's test modules (import the fixtures by name)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.calibration import CalibrationRecord
from schemas.episode import Episode, RewardComponent
from services.common.dataset import write_jsonl
from services.trainer.settings import TrainerSettings
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


def adapter_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")
