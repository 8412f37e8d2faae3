"""Topic ``cycles``: one record per phase of a continual-loop cycle (dataset → train → eval → promote).

Producer: ``fanroute loop``. Consumers: ``fanroute loop`` itself (a restarted loop resumes the cycle it
finds unfinished here, so a cycle is never lost and never promotes twice) and the console.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message, content_id

#: A cycle's phases in order; ``skipped``/``failed`` end a cycle early, ``finished`` ends it.
PHASES = ("started", "trained", "evaluated", "promoted", "finished")
Phase = Literal["started", "trained", "evaluated", "promoted", "finished", "skipped", "failed"]
ENDS = frozenset({"finished", "skipped", "failed"})


def cycle_id(model_id: str, kind: str, slot: datetime) -> str:
    """A cycle's id: one per (model id, router kind, scheduled slot), so a re-run of the slot is the same cycle."""
    return content_id("cycle", model_id, kind, slot.isoformat(), length=24)


def record_id(cycle: str, phase: str) -> str:
    """One record per (cycle, phase): a phase written again after a restart is the same record."""
    return content_id("cycle-record", cycle, phase, length=24)


class ProviderDrift(Message):
    """One provider's judged grade on the fan-out slice: the trained-on window against the latest one."""

    schema_version: Literal[1] = 1
    provider: str
    reference_mean: float | None = Field(description="Mean judge grade in the window the deployed router trained on")
    recent_mean: float | None = Field(description="Mean judge grade since the deployed router's cycle")
    reference_n: int = Field(ge=0)
    recent_n: int = Field(ge=0)
    delta: float | None = Field(default=None, description="recent − reference, in grade points (None: too few)")


class Drift(Message):
    """Drift on the fan-out slice: the largest per-provider grade change as a share of the grade scale."""

    schema_version: Literal[1] = 1
    score: float | None = Field(description="max |delta| / grade scale over providers with enough verdicts")
    threshold: float = Field(ge=0)
    triggered: bool
    worst: str | None = Field(default=None, description="The provider whose grade moved most")
    reference_until: datetime | None = None
    recent_since: datetime | None = None
    providers: tuple[ProviderDrift, ...] = ()


class CycleRecord(Message):
    """One phase of one cycle: what went in, what came out, how long it took."""

    schema_version: Literal[1] = 1
    record_id: str = Field(min_length=1)
    cycle_id: str = Field(min_length=1)
    phase: Phase
    at: datetime = Field(description="When this phase's record was written")
    model_id: str = Field(min_length=1)
    kind: Literal["lm", "linear"]
    slot: datetime = Field(description="The cycle's scheduled time: its dataset is the episodes topic as of then")
    trigger: Literal["schedule", "once", "drift", "demo"]
    code_version: str = Field(description="git describe of the loop's checkout, or the package version")
    episodes: int | None = Field(default=None, ge=0, description="Episodes in the cycle's dataset")
    new_episodes: int | None = Field(default=None, ge=0, description="Of those, appended since the last cycle's slot")
    adapter_in: str | None = Field(default=None, description="The deployed version the cycle started from")
    adapter_out: str | None = Field(default=None, description="The candidate version it trained and published")
    figures: dict[str, float] = Field(default_factory=dict, description="Eval figures (held-out, this cycle's window)")
    decision: Literal["promote", "refuse"] | None = None
    reasons: tuple[str, ...] = ()
    drift: Drift | None = None
    timings_s: dict[str, float] = Field(default_factory=dict, description="Seconds per phase so far")
    reason: str = Field(default="", max_length=2000, description="Why it was skipped or failed")
