"""Smoke test of bench/linear_decision.py: both ways timed on the same queries, the same probabilities.
No timing is asserted (speed is for the benchmark to report)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from bench.linear_decision import main
from schemas.episode import ChatMessage, Episode
from services.common.prompt import router_turns

NAMES = ("aero", "biomed", "web")
QUERIES = {"aero": ["supersonic wing flow", "shock wave at mach two", "wing flutter"],
           "biomed": ["protein in heart cells", "blood pressure of patients", "liver enzyme activity"]}


def test_a_short_run_times_both_and_agrees(tmp_path):
    episodes = tmp_path / "episodes.jsonl"
    lines = []
    for label, queries in QUERIES.items():
        for k in range(6):
            ep = Episode(episode_id=f"ep{len(lines)}", trace_id=f"t{len(lines)}", created_at=datetime.now(UTC),
                         messages=(*router_turns(NAMES, f"{queries[k % 3]} {k}"),
                                   ChatMessage(role="assistant", content=f"{label} > web")),
                         rewards=(), primary_reward=None, label_rule="test")
            lines.append(ep.model_dump_json())
    episodes.write_text("\n".join(lines) + "\n")
    queries = tmp_path / "eval.json"
    queries.write_text(json.dumps({"queries": [{"query": q} for q in ("a wing", "heart protein", "", "zzz")]}))
    out = main(["--episodes", str(episodes), "--queries-file", str(queries), "--rounds", "2",
                "--out", str(tmp_path / "out.json")])
    assert out["n_queries"] == 4 and out["max_abs_proba_diff"] < 1e-12
    assert out["pipeline"]["p50_ms"] > 0 and out["compiled"]["p50_ms"] > 0
    assert json.loads((tmp_path / "out.json").read_text())["classes"] == ["aero", "biomed"]


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--episodes", str(tmp_path / "none.jsonl"), "--queries-file", str(tmp_path / "q.json")])
    assert "none.jsonl" in capsys.readouterr().err
