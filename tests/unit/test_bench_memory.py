"""The memory benchmarks run end to end on small inputs and report both sides (figures: bench/results/)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from services.common.dataset import write_jsonl
from tests.support.tiny_model import build_tiny_model
from tests.support.trainer_runs import episode

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sft_memory_trains_both_sides_on_the_same_steps(tmp_path: Path, capsys) -> None:
    tiny = build_tiny_model(tmp_path / "tiny")
    data = write_jsonl([episode(i, query=f"query {'long ' * (i % 7)}{i}") for i in range(16)], tmp_path / "e.jsonl")
    out = tmp_path / "sft_memory.json"
    assert load("sft_memory").main(["--episodes", str(data), "--steps", "3", "--micro", "64", "--threads", "1",
                                    "--base-model", str(tiny), "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["baseline"]["steps"] == report["micro"]["steps"] == 2  # 16 episodes, 8 a batch: one pass
    assert report["baseline"]["max_micro_batches"] == 1 and report["micro"]["max_micro_batches"] > 1
    assert report["max_loss_difference"] < 1e-2 and report["peak_ratio"] > 0  # dropout masks fall differently
    with pytest.raises(SystemExit):
        load("sft_memory").main(["--episodes", str(tmp_path / "missing.jsonl")])
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.kafka
@pytest.mark.redis
def test_service_rss_measures_the_baseline_and_a_service(kafka_bootstrap, redis_url, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FANROUTE_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("FANROUTE_REDIS__URL", redis_url)
    out = tmp_path / "service_rss.json"
    bench = load("service_rss")
    assert bench.main(["--services", "baseline,publisher", "--window", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())["services"]
    assert report["baseline"]["steady_mb"] > 10 and report["baseline"]["vs_baseline"] == 1.0
    assert report["publisher"]["steady_mb"] > 10 and report["publisher"]["peak_mb"] >= report["publisher"]["ready_mb"] * 0.9
    with pytest.raises(SystemExit):
        bench.main(["--services", "nonesuch"])
