"""bench/judge_models.py: one model's gate figure and label quality from a demo's traces; a bad folder is named."""

from __future__ import annotations

import pytest

from tests.support.records import adi, adi_trace


def test_a_folder_without_a_demo_is_named(tmp_path):
    from bench.judge_models import main, parse

    with pytest.raises(SystemExit, match=r"train/episodes.jsonl does not exist"):
        main(parse(["--demo-dir", str(tmp_path)]))


def test_a_model_that_is_not_a_folder_is_named_before_anything_is_read(tmp_path):
    from bench.judge_models import main, parse

    with pytest.raises(SystemExit, match=r"--model .*no-such-model is not a folder"):
        main(parse(["--demo-dir", str(tmp_path), "--model", str(tmp_path / "no-such-model")]))


def test_the_default_judge_is_tuned_on_the_tuning_half_and_its_labels_scored_on_the_training_split(monkeypatch):
    import bench.judge_models
    from bench.judge_models import compare
    from services.common.splits import dev_half
    from services.providers.human import QrelsStore, human_grades

    qids = sorted(adi()[1], key=int)[:12]
    traces = [adi_trace(q, trace_id=f"adi-{q}") for q in qids]
    store = QrelsStore()
    human = {t.trace_id: human_grades(t, store) for t in traces}
    assert {dev_half(f"adi/{q}") for q in qids} == {"tune", "validation"}
    train = {t.trace_id for t in traces[:8]}
    monkeypatch.setattr(bench.judge_models, "WEIGHTS", (0.5, 0.9))  # a short grid: the search is judge_tune's own
    r = compare("minilm", None, traces, human, train, {"good": 0.004, "cheap": 0.001, "flaky": 0.002})
    assert r["train_queries"] == 8
    assert r["train_validation_queries"] == sum(dev_half(f"adi/{q}") == "validation" for q in qids[:8])
    assert -1 <= r["tau_b_validation"] <= 1 and 0 < r["cut_points"][0] < r["cut_points"][1] < r["cut_points"][2]
    # `good` cites the relevant documents, `cheap` irrelevant ones: a judge worth its gate labels `good`
    assert r["labels_ndcg10_train"] >= 0.75 > max(human[k].ndcg["cheap"] for k in train)
