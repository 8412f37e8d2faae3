"""Episodes as ATIF trajectories, validated by the independent ``atif`` package (it implements v1.8)."""

from __future__ import annotations

import json

import atif
import pydantic
import pytest

from schemas.base import canonical_json
from schemas.episode import ChatMessage, Episode, RewardComponent
from schemas.verdict import CandidateGrade, Verdict
from services.episodes.atif import ATIF_VERSION, episode_to_atif, write_atif
from services.episodes.build import build_episode
from tests.support.records import NOW, trace


def _episode() -> Episode:
    """A built episode of a two-provider trace with one extra reward component."""
    verdict = Verdict(verdict_id="v1", trace_id="t1", judged_at=NOW, judge_kind="test", judge_model="m",
                      rubric_version="r1", rubric_hash="0123456789", status="ok",
                      sampled_because="sampled",
                      grades=(CandidateGrade(provider="a", grade=3), CandidateGrade(provider="b", grade=1)),
                      ordering=(("a",), ("b",)))
    extra = RewardComponent(component_id="c-lat", name="latency", value=0.5, source="telemetry.csv")
    return build_episode(trace(), verdict, [extra], now=NOW)


def _as_v18(document: dict) -> dict:
    """A copy relabelled ATIF-v1.8: v1.8 only added audio content parts, so nothing else changes."""
    return {**document, "schema_version": "ATIF-v1.8"}


def test_trajectory_has_the_atif_shape():
    ep = _episode()
    doc = episode_to_atif(ep, model_name="smollm2-router")
    assert doc["schema_version"] == ATIF_VERSION == "ATIF-v1.7"
    assert doc["session_id"] == ep.episode_id
    assert doc["agent"]["name"] == "fanroute-router" and doc["agent"]["model_name"] == "smollm2-router"
    assert doc["agent"]["version"]
    assert [s["step_id"] for s in doc["steps"]] == [1, 2, 3]
    assert [s["source"] for s in doc["steps"]] == ["system", "user", "agent"]
    assert [s["message"] for s in doc["steps"]] == [m.content for m in ep.messages]
    assert doc["steps"][2]["message"] == "a > b"
    assert doc["final_metrics"]["total_steps"] == 3
    assert doc["final_metrics"]["extra"]["rewards"] == {r.name: r.value for r in ep.rewards}
    assert doc["final_metrics"]["extra"]["rewards"]["latency"] == 0.5
    assert doc["extra"]["trace_id"] == "t1"


def test_model_name_is_left_out_when_unknown():
    assert "model_name" not in episode_to_atif(_episode())["agent"]


def test_written_file_validates_with_the_atif_package(tmp_path):
    ep = _episode()
    path = write_atif(ep, tmp_path)
    assert path == tmp_path / f"{ep.episode_id}.json"
    document = json.loads(path.read_bytes())
    # The package does not constrain schema_version, so the v1.7 file validates as written ...
    parsed = atif.Trajectory.model_validate(document)
    assert parsed.schema_version == "ATIF-v1.7"
    assert [s.source for s in parsed.steps] == ["system", "user", "agent"]
    assert parsed.final_metrics is not None and parsed.final_metrics.extra is not None
    # ... and, relabelled, as the v1.8 document it also is.
    assert atif.Trajectory.model_validate(_as_v18(document)).schema_version == "ATIF-v1.8"


def test_written_file_is_canonical_and_deterministic(tmp_path):
    ep = _episode()
    first = write_atif(ep, tmp_path / "one", agent_version="1.2.3").read_bytes()
    second = write_atif(ep, tmp_path / "two", agent_version="1.2.3").read_bytes()
    assert first == second == canonical_json(episode_to_atif(ep, agent_version="1.2.3"))
    assert list(json.loads(first)) == sorted(json.loads(first))


def test_multi_turn_episode_gets_one_agent_step_per_assistant_turn():
    turns = [("system", "s"), ("user", "q1"), ("assistant", "a > b"), ("user", "q2"), ("assistant", "b > a")]
    ep = Episode(episode_id="e2", created_at=NOW, token_ids=(1, 2, 3),
                 messages=tuple(ChatMessage(role=r, content=c) for r, c in turns))
    doc = episode_to_atif(ep)
    assert [s["source"] for s in doc["steps"]] == ["system", "user", "agent", "user", "agent"]
    assert doc["final_metrics"]["extra"]["rewards"] == {}
    assert doc["extra"]["token_ids"] == [1, 2, 3] and "trace_id" not in doc["extra"]
    atif.Trajectory.model_validate(json.loads(canonical_json(doc)))


def test_the_validator_is_not_vacuous():
    """The checks we rely on really reject: a step_id gap, and an agent-only field on a user step."""
    doc = episode_to_atif(_episode())
    gap = {**doc, "steps": [{**s, "step_id": s["step_id"] + 1} for s in doc["steps"]]}
    with pytest.raises(pydantic.ValidationError):
        atif.Trajectory.model_validate(gap)
    bad_user = {**doc, "steps": [{**doc["steps"][0], "model_name": "m"}, *doc["steps"][1:]]}
    with pytest.raises(pydantic.ValidationError):
        atif.Trajectory.model_validate(bad_user)


def test_an_episode_id_that_is_not_a_file_name_is_refused(tmp_path):
    ep = _episode().model_copy(update={"episode_id": "../escape"})
    with pytest.raises(ValueError, match="not a plain file name"):
        write_atif(ep, tmp_path)
