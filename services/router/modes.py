"""How a router is asked (one home for the gateway's, ``fanroute eval``'s and the benchmark's default)."""

from __future__ import annotations

from typing import Literal

from schemas.trace import RouteDecision

RouterMode = Literal["score", "first-token", "generate"]
MODES: tuple[RouterMode, ...] = ("score", "first-token", "generate")
#: How the gateway and ``fanroute eval`` ask the router unless told otherwise.
DEFAULT_MODE: RouterMode = "score"

#: How a scored router's probabilities become a decision: ``first-choice`` routes by P(the provider is
#: the judge's cost-aware first choice); ``top-tier`` by P(it is in the judge's top tier), through the
#: router's top-tier table (services/router/rates.py; a router without one decides by the first choice).
Decision = RouteDecision
DECISIONS: tuple[Decision, ...] = ("top-tier", "first-choice")
DEFAULT_DECISION: Decision = "top-tier"
