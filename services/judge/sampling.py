"""Which traces get judged: every contested one, the rest at a rate, decided from the trace id.

A routed trace is never contested (one provider answered; there is no disagreement to resolve), so
routed traffic is judged at the rate only, whatever its signals say.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from schemas.trace import Trace

Reason = Literal["contested", "sampled"]


def unit_hash(trace_id: str) -> float:
    """A uniform number in [0, 1) derived from the trace id (same id, same number, every run)."""
    return int(hashlib.sha256(f"sample\x00{trace_id}".encode()).hexdigest()[:13], 16) / 16**13


def sample_reason(trace: Trace, rate: float) -> Reason | None:
    """``contested`` always (never for a routed trace); otherwise ``sampled`` for a ``rate`` share of ids;
    else None (skip)."""
    if trace.signals.contested and trace.mode != "routed":
        return "contested"
    return "sampled" if unit_hash(trace.trace_id) < rate else None
