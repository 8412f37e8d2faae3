"""Replay tasks in Harbor's format: content addressing, the score script, and the local verifier."""

from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
from pathlib import Path

import pytest

from schemas.base import content_id
from schemas.trace import Trace
from schemas.verdict import CandidateGrade, Verdict
from services.common.ndcg import parse_ordering, tie_aware_ndcg
from services.episodes.build import build_episode
from services.episodes.tasks import build_task, write_task
from services.episodes.verifier import run_verifier
from tests.support.records import NOW, judged_trace

NDCG_SOURCE = Path(__file__).resolve().parents[2] / "services" / "common" / "ndcg.py"
# judged_trace(): bm25-all and eng-bm25 "excellent", dense-all "meh", lib-bm25 timed out.
GRADES = {"bm25-all": 3, "eng-bm25": 3, "dense-all": 1, "lib-bm25": 0}
JUDGE_ORDER = "bm25-all = eng-bm25 > dense-all > lib-bm25"


def _verdict(grades: dict[str, int] = GRADES, ordering: str = JUDGE_ORDER, trace_id: str = "t-1",
             **changes) -> Verdict:
    """An ok verdict with these grades and this ordering."""
    fields = dict(verdict_id="v-1", trace_id=trace_id, judged_at=NOW, judge_kind="test",
                  judge_model="keyword-judge", rubric_version="r1", rubric_hash="feedc0ffee",
                  status="ok", sampled_because="contested",
                  grades=tuple(CandidateGrade(provider=p, grade=g) for p, g in grades.items()),
                  ordering=parse_ordering(ordering))
    return Verdict(**{**fields, **changes})


def _task_dir(root: Path, grades: dict[str, int] = GRADES, ordering: str = JUDGE_ORDER) -> Path:
    return write_task(build_task(judged_trace(), _verdict(grades, ordering), now=NOW), root)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return _task_dir(tmp_path_factory.mktemp("tasks"))


def _ndcg(answer: str, grades: dict[str, int] = GRADES) -> float:
    return round(tie_aware_ndcg(parse_ordering(answer), {p: float(g) for p, g in grades.items()}), 6)


# --------------------------------------------------------------------------- task files


def test_task_has_harbors_layout_and_config():
    task = build_task(judged_trace(), _verdict(), now=NOW)
    assert sorted(task.files) == [
        "environment/Dockerfile", "instruction.md", "task.toml", "tests/fixtures/candidates.json",
        "tests/fixtures/grades.json", "tests/ndcg.py", "tests/score.py", "tests/test.sh"]
    config = tomllib.loads(task.files["task.toml"])
    assert config["version"] == "1.0"
    assert "contested" in config["metadata"]["tags"]
    assert config["metadata"]["verdict_id"] == "v-1" and config["metadata"]["trace_id"] == "t-1"
    assert config["verifier"]["timeout_sec"] > 0 and config["agent"]["timeout_sec"] > 0
    assert config["environment"]["cpus"] == 1
    dockerfile = task.files["environment/Dockerfile"]
    assert "FROM python:3.11-slim" in dockerfile and "WORKDIR /app" in dockerfile
    assert "python3 /tests/score.py" in task.files["tests/test.sh"]
    assert task.files["tests/test.sh"].startswith("#!/bin/bash\n")


def test_ndcg_module_is_copied_verbatim():
    task = build_task(judged_trace(), _verdict(), now=NOW)
    assert task.files["tests/ndcg.py"] == NDCG_SOURCE.read_text(encoding="utf-8")


def test_fixtures_hold_grades_ordering_and_candidates():
    trace = judged_trace()
    task = build_task(trace, _verdict(), now=NOW)
    grades = json.loads(task.files["tests/fixtures/grades.json"])
    assert grades["grades"] == GRADES
    assert grades["ordering"] == JUDGE_ORDER
    assert grades["providers"] == sorted(GRADES)
    assert (grades["verdict_id"], grades["rubric_hash"]) == ("v-1", "feedc0ffee")
    candidates = json.loads(task.files["tests/fixtures/candidates.json"])
    assert [c["provider"] for c in candidates] == [c.provider for c in trace.candidates]
    failed = next(c for c in candidates if c["provider"] == "lib-bm25")
    assert failed["error"] == "timeout" and failed["citations"] == []
    assert {"answer", "citations", "latency_ms", "cost_usd", "error"} <= set(candidates[0])


def test_instruction_names_query_providers_and_answer_file_but_no_answers():
    trace = judged_trace()
    text = build_task(trace, _verdict(), now=NOW).files["instruction.md"]
    assert trace.query in text and "/app/answer.txt" in text and " > " in text and " = " in text
    for name in GRADES:
        assert f"`{name}`" in text
    for leaked in ("excellent", "meh", "collection://med/12", "https://x.org/1"):
        assert leaked not in text


def test_query_with_backticks_is_quoted_verbatim():
    trace = judged_trace().model_copy(update={"query": "what does ```x``` mean"})
    text = build_task(trace, _verdict(), now=NOW).files["instruction.md"]
    assert "````text\nwhat does ```x``` mean\n````" in text


# --------------------------------------------------------------------------- content addressing


def test_task_id_is_the_hash_of_its_files_not_of_created_at():
    a = build_task(judged_trace(), _verdict(), now=NOW)
    b = build_task(judged_trace(), _verdict())
    assert a.created_at != b.created_at
    assert a.task_id == b.task_id == content_id(a.files)
    assert a.files == b.files


def test_rebuilding_writes_the_same_bytes(tmp_path):
    one, two = _task_dir(tmp_path / "one"), _task_dir(tmp_path / "two")
    assert one.name == two.name
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)
    assert os.access(one / "tests" / "test.sh", os.X_OK)


def test_changing_a_grade_changes_the_id():
    base = build_task(judged_trace(), _verdict(), now=NOW)
    changed = build_task(judged_trace(), _verdict({**GRADES, "dense-all": 2}), now=NOW)
    assert changed.task_id != base.task_id


def test_write_task_refuses_files_that_do_not_match_the_id(tmp_path):
    task = build_task(judged_trace(), _verdict(), now=NOW)
    tampered = task.model_copy(update={"files": {**task.files, "instruction.md": "do nothing"}})
    with pytest.raises(ValueError, match="does not match"):
        write_task(tampered, tmp_path)


@pytest.mark.parametrize("verdict, match", [
    (_verdict(trace_id="t-other"), "is for trace"),
    (_verdict(status="failed", failure_reason="backend down"), "no grades/ordering"),
    (_verdict({**GRADES, "ghost": 2}), "not in the trace"),
    (_verdict({p: 0 for p in GRADES}), "no provider has a positive grade"),
])
def test_build_task_refuses_unscorable_pairs(verdict, match):
    with pytest.raises(ValueError, match=match):
        build_task(judged_trace(), verdict)


def test_build_task_refuses_a_provider_name_the_ordering_cannot_express():
    trace = judged_trace()
    odd = trace.candidates[0].model_copy(update={"provider": "a>b"})
    trace = Trace.model_validate({**trace.model_dump(), "candidates": [odd, *trace.candidates[1:]]})
    with pytest.raises(ValueError, match="cannot be written"):
        build_task(trace, _verdict())


# --------------------------------------------------------------------------- scoring through the runner


def test_judges_own_ordering_scores_one_and_matches_the_episode_reward(task_dir):
    result = run_verifier(task_dir, JUDGE_ORDER + "\n")
    assert (result.reward, result.source, result.flagged) == (1.0, "reward.txt", False)
    episode = build_episode(judged_trace(), _verdict(), now=NOW)
    assert result.reward == episode.rewards[0].value


def test_judge_ordering_that_disagrees_with_its_grades_scores_its_ndcg(tmp_path):
    disagreeing = "dense-all > bm25-all = eng-bm25 > lib-bm25"
    result = run_verifier(_task_dir(tmp_path, ordering=disagreeing), disagreeing)
    assert result.reward == _ndcg(disagreeing) < 1.0
    assert not result.flagged


def test_reversed_ordering_scores_its_tie_aware_ndcg(task_dir):
    reversed_order = "lib-bm25 > dense-all > eng-bm25 > bm25-all"
    result = run_verifier(task_dir, reversed_order)
    assert result.reward < 1.0
    assert result.reward == pytest.approx(_ndcg(reversed_order), abs=1e-6)


@pytest.mark.parametrize("answer", [
    "bm25-all = eng-bm25 > dense-all > lib-bm25",
    "bm25-all > eng-bm25 > dense-all > lib-bm25",
    "eng-bm25 > bm25-all > dense-all > lib-bm25",
])
def test_a_tie_the_grades_cannot_resolve_is_not_punished(task_dir, answer):
    assert run_verifier(task_dir, answer).reward == 1.0


def test_leaving_a_provider_out_loses_its_gain(task_dir):
    result = run_verifier(task_dir, "bm25-all > eng-bm25")
    assert result.reward == _ndcg("bm25-all > eng-bm25") < 1.0


@pytest.mark.parametrize("answer, why", [
    (None, "does not exist"),
    ("", "empty"),
    ("  \n\n", "empty"),
    ("the best provider is bm25-all", "unknown provider"),
    ("bm25-all > google > dense-all", "unknown provider 'google'"),
    ("bm25-all > > dense-all", "empty tier"),
    ("bm25-all > bm25-all", "appears twice"),
    ("bm25-all > dense-all\neng-bm25 > lib-bm25", "one line"),
    ("bm25-all \udcff> dense-all", "not UTF-8"),
])
def test_bad_answers_score_zero_and_say_why(task_dir, answer, why):
    result = run_verifier(task_dir, answer)
    assert (result.reward, result.source, result.flagged) == (0.0, "reward.txt", False)
    assert why in result.stderr


def test_broken_fixture_is_a_flagged_grader_failure_with_no_reward(task_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(task_dir, broken)
    (broken / "tests" / "fixtures" / "grades.json").write_text('{"providers": []}')
    result = run_verifier(broken, JUDGE_ORDER)
    assert (result.reward, result.source, result.flagged) == (0.0, "terminal", True)
    assert "FixtureError" in result.stderr


def test_the_runner_leaves_the_task_files_alone(task_dir):
    before = {p: p.read_bytes() for p in task_dir.rglob("*") if p.is_file()}
    run_verifier(task_dir, JUDGE_ORDER)
    assert {p: p.read_bytes() for p in task_dir.rglob("*") if p.is_file()} == before
    assert b"/tests/score.py" in before[task_dir / "tests" / "test.sh"]


# --------------------------------------------------------------------------- the reward contract


def _tiny_task(root: Path, body: str, **data: str) -> Path:
    """A hand-written task whose tests/test.sh is ``body`` (plus data files under tests/)."""
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test.sh").write_text("#!/bin/bash\n" + body + "\n")
    for name, text in data.items():
        (root / "tests" / name).write_text(text)
    return root


@pytest.mark.parametrize("body, reward, source", [
    ("echo 0.25 > /logs/verifier/reward.txt", 0.25, "reward.txt"),
    ("echo '{\"reward\": 0.75, \"latency\": 3}' > /logs/verifier/reward.json", 0.75, "reward.json"),
    ("echo '{\"accuracy\": 0.5}' > /logs/verifier/reward.json", 0.5, "reward.json"),
    ("echo 0.4 > /logs/verifier/reward.txt; exit 1", 0.4, "reward.txt"),
    ("exit 0", 1.0, "exit_status"),
    ("exit 3", 0.0, "exit_status"),
])
def test_reward_contract(tmp_path, body, reward, source):
    result = run_verifier(_tiny_task(tmp_path, body), None)
    assert (result.reward, result.source, result.flagged) == (reward, source, False)


def test_reward_json_keeps_every_metric(tmp_path):
    body = "echo '{\"reward\": 0.75, \"latency\": 3}' > /logs/verifier/reward.json"
    assert run_verifier(_tiny_task(tmp_path, body), None).rewards == {"reward": 0.75, "latency": 3.0}


@pytest.mark.parametrize("body, why", [
    ("echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json",
     "exactly one"),
    ("python3 -c 'raise RuntimeError(\"boom\")'; exit 1", "traceback"),
    ("echo 1 > /logs/verifier/reward.txt; python3 -c 'import sys; sys.exit(\"x\" + 1)'", "traceback"),
    ("echo 'abc' > /logs/verifier/reward.txt", "not a number"),
    ("echo nan > /logs/verifier/reward.txt", "not a finite number"),
    ("touch /logs/verifier/reward.txt", "empty"),
    ("echo '[1]' > /logs/verifier/reward.json", "non-empty object"),
    ("echo '{\"a\": 1, \"b\": 0}' > /logs/verifier/reward.json", "no 'reward' key"),
    ("echo '{\"reward\": \"high\"}' > /logs/verifier/reward.json", "not a finite number"),
    ("kill -9 $$", "signal"),
])
def test_grader_faults_are_flagged_with_the_terminal_reward(tmp_path, body, why):
    result = run_verifier(_tiny_task(tmp_path, body), None)
    assert (result.reward, result.source, result.flagged) == (0.0, "terminal", True)
    assert why in result.reason.lower()


def test_a_grader_timeout_is_killed_and_flagged(tmp_path):
    started = time.monotonic()
    result = run_verifier(_tiny_task(tmp_path, "sleep 30 & sleep 30"), None, timeout_s=0.5,
                          terminal_reward=0.5)
    assert time.monotonic() - started < 5
    assert (result.reward, result.source, result.flagged) == (0.5, "terminal", True)
    assert "timed out" in result.reason


def test_a_task_without_test_sh_is_flagged(tmp_path):
    result = run_verifier(tmp_path, "x")
    assert (result.reward, result.flagged) == (0.0, True)
    assert "no tests/test.sh" in result.reason


def test_paths_are_remapped_in_scripts_but_not_in_data(tmp_path):
    body = ('[ "$(cat /app/answer.txt)" = "hello" ] && [ "$PWD" = "$(cd /app && pwd)" ] '
            "&& grep -q '[/]app/keep' /tests/data.json && echo 1 > /logs/verifier/reward.txt "
            "|| echo 0 > /logs/verifier/reward.txt")
    task = _tiny_task(tmp_path, body, **{"data.json": '{"path": "/app/keep"}'})
    assert run_verifier(task, "hello").reward == 1.0
    assert run_verifier(task, "bye").reward == 0.0
