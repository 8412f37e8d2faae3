"""Topic ``traces``: one fan-out (or routed) request with every candidate.

Producer: gateway. Consumers: judge, episode builder.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from schemas.base import Message


class Citation(Message):
    """One cited document: a stable URL (``collection://<name>/<doc_id>`` for local providers)."""

    schema_version: Literal[1] = 1
    url: str = Field(min_length=1, max_length=4096, description="Stable URL or doc id")
    title: str = Field(default="", max_length=4096)
    rank: int = Field(ge=1, description="1-based rank in the provider's answer")
    snippet: str = Field(default="", max_length=16384)
    score: float | None = Field(default=None, description="Provider's own score, if it gives one")


class Candidate(Message):
    """One provider's answer to the query, or the error it failed with."""

    schema_version: Literal[1] = 1
    provider: str = Field(min_length=1, max_length=128)
    answer: str = Field(default="", description="Answer text built from the citations")
    citations: tuple[Citation, ...] = ()
    latency_ms: float = Field(ge=0)
    cost_usd: float = Field(ge=0)
    error: str | None = Field(default=None, description="Why the provider failed, if it did")
    error_kind: str | None = Field(default=None, description="timeout, http_error, bad_response, ...")

    @property
    def ok(self) -> bool:
        return self.error is None


class Signals(Message):
    """Selection-time signals; citation overlap decides what gets judged."""

    schema_version: Literal[1] = 1
    pairwise_overlap: dict[str, float] = Field(
        default_factory=dict,
        description="Jaccard overlap of cited URLs for each provider pair, keyed 'a|b' (sorted)",
    )
    mean_overlap: float = Field(ge=0, le=1)
    min_overlap: float = Field(ge=0, le=1)
    contested: bool
    contested_threshold: float = Field(ge=0, le=1)
    providers_ok: int = Field(ge=0)
    providers_failed: int = Field(ge=0)


RouteFallback = Literal["no_adapter", "router_timeout", "router_error", "unparseable"]
#: What a scored router's expected quality was (services/router/modes.py, services/router/rates.py).
RouteDecision = Literal["top-tier", "first-choice"]


class Route(Message):
    """How a routed request was answered: the router's ordering and the providers actually called."""

    schema_version: Literal[1] = 1
    router: str | None = Field(default=None, description="Served adapter name (``router@3``); None without one")
    router_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="Content digest of the adapter that answered, as the sampler named it (None: no adapter, a "
                    "server that names none, e.g. vLLM, or a linear router)")
    ordering: tuple[str, ...] = Field(default=(), description="The router's ordering, best first (empty on fallback)")
    called: tuple[str, ...] = Field(min_length=1, description="Providers called, in order (failover adds the next)")
    fallback: RouteFallback | None = Field(default=None,
                                           description="Why the best single provider answered instead of the router")
    fallback_provider: str | None = Field(default=None, description="The best single provider used on fallback")
    router_ms: float = Field(default=0.0, ge=0, description="Time spent asking the router")
    raw: str = Field(default="", max_length=4096, description="The router's reply text, as received")
    scores: dict[str, float] = Field(
        default_factory=dict, description="Scoring router: each provider name's summed log-probability as the "
                                          "continuation of the router prompt (empty when generating or on fallback)")
    cost_weight: float | None = Field(default=None, ge=0,
                                      description="λ of the decision: expected quality minus λ · cost (USD)")
    decision: RouteDecision | None = Field(
        default=None, description="What the expected quality was: P(in the judge's top tier), through the router's "
                                  "top-tier table, or P(the judge's cost-aware first choice); None without scores")


class Trace(Message):
    """A request, every candidate, and the signals computed while answering it."""

    schema_version: Literal[1] = 1
    trace_id: str = Field(min_length=1, max_length=128)
    received_at: datetime
    query: str = Field(min_length=1, max_length=4096)
    query_id: str | None = Field(default=None, description="Caller's id (e.g. '<collection>/<qid>')")
    mode: Literal["fanout", "routed"]
    router_version: str | None = Field(default=None, description="Adapter version, when routed")
    route: Route | None = Field(default=None, description="Routing decision, when routed")
    candidates: tuple[Candidate, ...]
    signals: Signals

    @model_validator(mode="after")
    def _routed_has_version(self) -> Trace:
        if self.mode == "routed":
            if self.route is None:
                raise ValueError("a routed trace must carry its route")
            if self.route.fallback != "no_adapter" and not self.router_version:
                raise ValueError("a routed trace must name its router_version (unless no adapter was promoted)")
        elif self.route is not None:
            raise ValueError("only a routed trace carries a route")
        names = [c.provider for c in self.candidates]
        if len(names) != len(set(names)):
            raise ValueError("candidates must have distinct provider names")
        return self
