"""Verdict builders for episode tests."""

from __future__ import annotations

from schemas.base import content_id
from schemas.verdict import CandidateGrade, Verdict
from tests.factories import NOW

GRADES = {"bm25-all": 3, "dense-all": 1, "eng-bm25": 3, "lib-bm25": 0}


def verdict_for(trace_id: str, *, model: str = "judge-a", rubric: str = "rubric-1",
                grades: dict[str, int] | None = None, status: str = "ok") -> Verdict:
    grades = grades or GRADES
    tiers = [tuple(sorted(p for p, g in grades.items() if g == level)) for level in (3, 2, 1, 0)]
    return Verdict(verdict_id=content_id("v", trace_id, model, rubric), trace_id=trace_id, judged_at=NOW,
                   judge_kind="test", judge_model=model, rubric_version="r", rubric_hash=rubric,
                   status=status, sampled_because="contested",
                   grades=tuple(CandidateGrade(provider=p, grade=g) for p, g in sorted(grades.items())),
                   ordering=tuple(t for t in tiers if t) if status == "ok" else ())
