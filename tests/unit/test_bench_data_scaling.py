"""Smoke test of bench/data_scaling.py on the tiny model: the sizes are development episodes first, then
synthetic ones; only held-out development traces (with qrels) are scored; both routers get a row, decided
as the demo's gateway decides, beside the best single provider."""

from __future__ import annotations

import json

import pytest

from bench.data_scaling import main
from services.common.dataset import write_jsonl
from tests.support.records import adi, adi_trace, episode
from tests.support.tiny_model import build_tiny_model


def test_a_short_curve_from_a_run_dir(tmp_path):
    qids = sorted(adi()[0], key=int)  # ADI's 28 queries with qrels
    dev = [adi_trace(q) for q in qids[:12]]
    synth = [adi_trace(q, trace_id=f"s{i}").model_copy(update={"query_id": f"adi/synth-{i}-title",
                                                                "query": f"synthetic query {i}"})
             for i, q in enumerate(qids[12:20])]
    held = [adi_trace(q) for q in qids[20:28]]
    names = ["cheap", "flaky", "good"]
    eps = [episode(t.query, "good > cheap = flaky" if i % 3 else "cheap > good > flaky", names, ep_id=f"e{i}",
                   trace_id=t.trace_id) for i, t in enumerate(dev + synth)]
    run = tmp_path / "run"
    write_jsonl(eps, run / "train" / "episodes.jsonl")
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "traces.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in dev + synth + held))
    base = build_tiny_model(tmp_path / "tiny", context=1024)
    out = tmp_path / "scaling.json"
    assert main(["--run-dir", str(run), "--sizes", "10,15,100", "--base-model", str(base),
                 "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["episodes"] for r in rep["rows"]] == [10, 15, 20]  # 100 is capped at what exists
    assert [r["synthetic"] for r in rep["rows"]] == [0, 3, 8]
    assert rep["held_out"] == 8 and rep["held_out_with_qrels"] == 8
    assert (rep["decision"], rep["cost_weight"]) == ("top-tier", 150.0)  # the demo's, as the gateway decides
    for r in rep["rows"]:
        for router in ("lm", "linear", "best_single"):
            assert 0.0 <= r[router]["ndcg10"] <= 1.0 and r[router]["n_qrels"] == rep["held_out_with_qrels"]
            assert r[router]["cost"] > 0
        assert r["best_single"]["shares"] == {r["best_single"]["provider"]: 1.0}
        assert "agree" not in r["lm"]  # held-out episodes carry no judge label to agree with
    assert out.with_suffix(".png").stat().st_size > 0
    # the same work directory again: each pass trains afresh instead of refusing the last run's checkpoints
    again = tmp_path / "again.json"
    assert main(["--run-dir", str(run), "--sizes", "10", "--base-model", str(base),
                 "--work-dir", str(tmp_path / "work"), "--out", str(again)]) == 0
    assert json.loads(again.read_text())["rows"][0]["lm"] == rep["rows"][0]["lm"]


@pytest.mark.parametrize("flags, says", [(["--cost-weight", "-1"], "--cost-weight"), (["--passes", "0"], "--passes"),
                                         (["--decision", "best"], "--decision")])
def test_a_bad_flag_is_refused_by_name_before_any_work(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_:
        main(["--run-dir", str(tmp_path / "missing"), *flags])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
