"""Which traces get judged: every contested one, the rest at a rate, decided from the trace id."""

from __future__ import annotations

import hashlib
from typing import Literal

from schemas.trace import Trace

Reason = Literal["contested", "sampled"]


def unit_hash(trace_id: str) -> float:
    """A uniform number in [0, 1) derived from the trace id (same id, same number, every run)."""
    return int(hashlib.sha256(f"sample\x00{trace_id}".encode()).hexdigest()[:13], 16) / 16**13


def sample_reason(trace: Trace, rate: float) -> Reason | None:
    """``contested`` always; otherwise ``sampled`` for a ``rate`` share of ids; else None (skip)."""
    if trace.signals.contested:
        return "contested"
    return "sampled" if unit_hash(trace.trace_id) < rate else None
