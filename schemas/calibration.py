"""Topics ``calibrations`` and ``reviews``: judge-vs-human agreement, the gate, and review marks.

Producer of both: ``fanroute calibrate`` (report/import, mark). Consumers: anything that trains
from verdicts asks the latest ``calibrations`` record of its judge key whether the gate is open;
``reviews`` accumulate the human-labelled set over time.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message, content_id


def gate_key(judge_kind: str, judge_model: str, rubric_hash: str, providers: list[str] | tuple[str, ...]) -> str:
    """The calibration key: a new judge, rubric or provider set must be calibrated again."""
    return content_id("gate", judge_kind, judge_model, rubric_hash, sorted(providers), length=24)


class ProviderAgreement(Message):
    """Agreement figures restricted to one provider, with how many traces they rest on."""

    schema_version: Literal[1] = 1
    tau_b: float | None = None
    top1: float | None = None
    n: int = Field(ge=0)


class CalibrationRecord(Message):
    """One calibration of (judge, rubric, provider set) against human labels; the gate is ``open``."""

    schema_version: Literal[1] = 1
    gate_key: str = Field(min_length=1)
    created_at: datetime
    judge_kind: str
    judge_model: str
    rubric_hash: str
    providers: tuple[str, ...]
    human_source: Literal["qrels", "hand-ranked"]
    tau_b: float | None = Field(description="Mean per-trace Kendall tau-b, judge vs human orderings")
    top1: float | None = Field(description="Share of traces whose top tiers agree")
    n: int = Field(ge=0, description="Traces compared")
    threshold: float = Field(ge=-1, le=1)
    open: bool
    per_provider: dict[str, ProviderAgreement] = Field(default_factory=dict)


class Review(Message):
    """A person's agree/disagree mark on one verdict (idempotent by verdict and reviewer)."""

    schema_version: Literal[1] = 1
    review_id: str = Field(min_length=1)
    verdict_id: str = Field(min_length=1)
    reviewer: str = Field(min_length=1, max_length=128)
    mark: Literal["agree", "disagree"]
    note: str = Field(default="", max_length=4000)
    created_at: datetime
