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
    human_source: Literal["qrels", "hand-ranked", "reviews"]
    tau_b: float | None = Field(description="Mean per-trace Kendall tau-b, judge vs human orderings")
    top1: float | None = Field(description="Share of traces whose top tiers agree")
    n: int = Field(ge=0, description="Traces compared")
    threshold: float = Field(ge=-1, le=1)
    open: bool
    per_provider: dict[str, ProviderAgreement] = Field(default_factory=dict)


def review_id(verdict_id: str, reviewer: str) -> str:
    """A review's id: one per (verdict, reviewer), so a person's new mark replaces their old one."""
    return content_id("review", verdict_id, reviewer)


class Review(Message):
    """A person's agree/disagree mark on one verdict (idempotent by verdict and reviewer).

    What recomputes the gate from people's labels (additive fields, defaulted for older marks): the judge key
    the verdict belongs to and, on a disagree, the person's own ordering (tiers, ties allowed); an agree
    means the judge's ordering."""

    schema_version: Literal[1] = 1
    review_id: str = Field(min_length=1)
    verdict_id: str = Field(min_length=1)
    reviewer: str = Field(min_length=1, max_length=128)
    mark: Literal["agree", "disagree"]
    note: str = Field(default="", max_length=4000)
    created_at: datetime
    trace_id: str | None = Field(default=None, max_length=128, description="The verdict's trace")
    judge_key: str | None = Field(default=None, max_length=256,
                                  description="The gate key of the judge that wrote the verdict (kind, model, rubric, "
                                              "providers)")
    ordering: tuple[tuple[str, ...], ...] = Field(
        default=(), description="On a disagree: the person's ordering of the providers, best first, ties in one tier")
    source: str = Field(default="cli", max_length=64, description="Where the mark was made: cli, console")
