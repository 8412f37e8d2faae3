"""Topic ``verdicts``: the judge's blind grades and ordering for one trace.

Producer: judge. Consumer: episode builder. Filled in by the judge issue; the shape is fixed here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message


class CandidateGrade(Message):
    """A 0–3 UMBRELA relevance grade for one provider's candidate."""

    schema_version: Literal[1] = 1
    provider: str = Field(min_length=1, max_length=128)
    letter: str | None = Field(default=None, min_length=1, max_length=2,
                               description="Blind label the judge saw (A, B, ...); None if not shown")
    grade: int = Field(ge=0, le=3)
    judged: bool = Field(default=True, description="False: graded 0 by rule (the provider failed, "
                                                   "so there was nothing to show the judge)")


class Verdict(Message):
    """Grades per provider plus one listwise ordering in which ties are allowed."""

    schema_version: Literal[1] = 1
    verdict_id: str = Field(min_length=1, description="Derived from (trace_id, judge_model, rubric_hash)")
    trace_id: str = Field(min_length=1)
    judged_at: datetime
    judge_kind: str = Field(min_length=1, description="local, openai, anthropic, ...")
    judge_model: str = Field(min_length=1)
    judge_endpoint: str | None = None
    rubric_version: str = Field(min_length=1)
    rubric_hash: str = Field(min_length=1)
    status: Literal["ok", "failed"]
    failure_reason: str | None = None
    sampled_because: Literal["contested", "sampled", "forced"]
    grades: tuple[CandidateGrade, ...] = ()
    ordering: tuple[tuple[str, ...], ...] = Field(
        default=(), description="Tiers of provider names, best first; names in one tier are tied"
    )
    letters: dict[str, str] = Field(default_factory=dict,
                                    description="Audit trail: blind letter -> provider name")
    shuffle_seed: str = Field(default="", description="What the letter shuffle was derived from")
