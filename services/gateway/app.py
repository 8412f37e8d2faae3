"""The gateway: ``POST /v1/search`` → every provider (fan-out) or the router's pick (routed mode) → a
Trace on the ``traces`` topic."""

from __future__ import annotations

import asyncio
import os
import logging
import time
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from schemas.topics import topic
from schemas.trace import Candidate, Route, Signals
from services.common import paths
from services.common.bus import Bus
from services.common.http import BodyLimit, lifespan_of
from services.common.http import error as error_response
from services.common.openapi import NON_BLANK, PROMETHEUS, install_contract, prometheus
from services.common.spool import SpoolError
from services.common.stamps import StampStore
from services.gateway.ids import trace_id_for
from services.gateway.metrics import GatewayMetrics
from services.gateway.link import KafkaLink
from services.gateway.outbox import TraceOutbox, default_spool_dir
from services.gateway.workers import orphan_spool_dirs, worker_spool_dir
from services.gateway.push import RESPONSES as PUSH_RESPONSES
from services.gateway.push import push
from services.gateway.push import request_body as push_body
from services.gateway.routed import RoutedMode
from services.gateway.settings import GatewaySettings
from services.providers.base import Provider
from services.providers.fanout import fan_out_trace
from services.providers.fusion import FusedResult, rrf
from services.providers.registry import build_provider
from services.router.client import RouterClient

log = logging.getLogger(__name__)
TRACE_HEADER = "X-Fanroute-Trace"


class SearchRequest(BaseModel):
    """A search; ``request_id`` makes a retried request produce the same trace id."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: str = Field(description="The user's query: not only whitespace, at most max_query_chars characters",
                       json_schema_extra={"minLength": 1, "pattern": NON_BLANK})
    query_id: str | None = Field(default=None, max_length=256, description="Caller's id for the query")
    request_id: str | None = Field(default=None, min_length=1, max_length=128,
                                   description="Idempotency key: the trace id is derived from it, the query "
                                               "and query_id (a retry gets the same id, another query does not)")


class SearchResponse(BaseModel):
    """The candidates called, one fused list, the signals, the route (routed mode), and where the trace
    is: on Kafka (``published``) or in the gateway's durable spool, re-published when Kafka is back
    (``spooled``)."""

    trace_id: str
    mode: str = Field(description="fanout (every provider) or routed (the router's pick)")
    query: str
    candidates: list[Candidate]
    fused: list[FusedResult]
    signals: Signals
    trace_status: Literal["published", "spooled"] = Field(
        description="published: Kafka acknowledged the trace; spooled: it did not within publish_wait_s, so "
                    "the trace was written (fsynced) to the gateway's spool and is re-published from there")
    trace_published: bool = Field(deprecated=True,
                                  description="Deprecated: trace_status == 'published' (false means spooled, "
                                              "not lost)")
    trace_error: str | None = Field(default=None, description="Why the trace was spooled")
    route: Route | None = Field(default=None, description="How a routed request was answered")


class Gateway:
    """Providers, bus, metrics and (when enabled) routed mode of one running gateway; the routes call into it."""

    def __init__(self, settings: GatewaySettings, bus: Bus, providers: list[Provider], *,
                 stamps: StampStore | None = None, router_client: RouterClient | None = None) -> None:
        self.settings = settings
        self.bus = bus
        self.providers = providers
        self.metrics = GatewayMetrics(multiprocess=settings.worker_index is not None)
        for p in providers:
            for outcome in ("ok", "error"):
                self.metrics.provider_calls.labels(p.name, outcome)
        spool_base = settings.spool_dir or default_spool_dir(settings.cache_dir)
        self.outbox = TraceOutbox(bus, self.metrics, spool_dir=worker_spool_dir(spool_base, settings),
                                  publish_wait_s=settings.publish_wait_s, max_bytes=settings.spool_max_bytes,
                                  max_records=settings.spool_max_records, check_topic=settings.spool_check_topic)
        self.outbox.adopt_from = orphan_spool_dirs(spool_base, settings)
        self._gauges: asyncio.Task[None] | None = None
        topics = (topic("traces"), topic("episodes")) + ((topic("adapters"),) if settings.routing.enabled else ())
        self.link = KafkaLink(bus, topics, connect_timeout_s=settings.kafka_connect_timeout_s,
                              on_connected=self.outbox.wake, required=settings.require_kafka_at_start)
        self.outbox.kafka_ready = lambda: self.link.connected
        self.outbox.on_stuck_producer = self.link.reconnect
        self.routed = (RoutedMode(settings, providers, bus, self.metrics, stamps=stamps, client=router_client)
                       if settings.routing.enabled else None)

    async def start(self) -> None:
        """Providers, then the spool, then Kafka: an unreachable broker does not keep the gateway from
        serving (:mod:`services.gateway.link`); its traces are spooled until the broker answers."""
        t0 = time.perf_counter()
        await asyncio.gather(*(p.start() for p in self.providers))
        if self.routed is not None:
            self.routed.subscribe()
        await self.outbox.start()
        await self.link.start()
        if self.routed is not None:
            await self.routed.start()
        if self.metrics.multiprocess:
            self._gauges = asyncio.create_task(self._export_gauges(), name="export-gauges")
        log.info("gateway ready in %.1fs with providers %s (%s; Kafka %s)", time.perf_counter() - t0,
                 [p.name for p in self.providers], "routed" if self.routed else "fan-out", self.link.state)

    async def stop(self) -> None:
        """Within ``shutdown_timeout_s`` whatever Kafka does; the spool is closed intact."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        if self._gauges is not None:
            self._gauges.cancel()
        if self.routed is not None:
            await self.routed.stop()
        await asyncio.gather(*(p.close() for p in self.providers), return_exceptions=True)
        await self.outbox.stop()
        await self.link.stop(deadline - time.monotonic())

    async def _export_gauges(self) -> None:
        """A worker of several writes its spool gauges out every second (the others' scrapes read them)."""
        while True:
            self.outbox.export_gauges()
            await asyncio.sleep(1.0)  # a refresh period, not a synchronisation

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of ``/healthz``: ``ok``; ``degraded`` (200: every request is still answered
        and its trace kept) while Kafka is unreachable or the spool drains; ``unavailable`` (503, so a load
        balancer takes this gateway out) when Kafka is unreachable and the spool cannot take more — then a
        request's trace could be kept nowhere and the request is refused 503 anyway."""
        spool = self.outbox.describe()
        reasons = []
        if not self.link.connected:
            reasons.append(f"Kafka unreachable ({self.link.error or 'connecting'}): traces are spooled")
        if spool["depth"]:
            reasons.append(f"{spool['depth']} traces in the spool, re-published as Kafka acknowledges")
        full = not self.outbox.can_take_more()
        if full:
            reasons.append(f"the spool cannot take more ({spool.get('error') or 'at its limit'})")
        status = "unavailable" if full and not self.link.connected else "degraded" if reasons else "ok"
        body = {"status": status, "providers": [p.name for p in self.providers],
                "kafka": "memory" if self.bus.in_memory else self.settings.kafka.bootstrap_servers,
                "link": self.link.describe(), "spool": spool}
        if reasons:
            body["reasons"] = reasons
        if self.routed is not None:
            body["routing"] = self.routed.describe()
        if self.settings.worker_index is not None:
            body["worker"] = {"index": self.settings.worker_index, "of": self.settings.workers, "pid": os.getpid()}
        return (503 if status == "unavailable" else 200), body

    async def search(self, req: SearchRequest, query: str) -> tuple[SearchResponse, float]:
        """Fan out (or route), build and publish (or spool) the trace.

        Returns the response and the answering's wall time in ms; raises :class:`SpoolError` when Kafka
        did not acknowledge the trace in time and the spool could not take it.
        """
        t0 = time.perf_counter()
        trace_id = trace_id_for(req.request_id, query, req.query_id)
        if self.routed is not None and not self.routed.fans_out(req.request_id or req.query_id or trace_id):
            trace = await self.routed.trace(query, trace_id=trace_id, query_id=req.query_id)
        else:
            trace = await fan_out_trace(self.providers, query, trace_id=trace_id, query_id=req.query_id,
                                        deadline_s=self.settings.deadline_s,
                                        contested_threshold=self.settings.contested_threshold)
        answer_ms = (time.perf_counter() - t0) * 1000.0
        candidates, signals = list(trace.candidates), trace.signals
        status, error = await self.outbox.publish(trace)
        self._observe(trace.mode, candidates, signals, time.perf_counter() - t0)
        fused = rrf(candidates, k=self.settings.rrf_k, limit=self.settings.fused_limit)
        return SearchResponse(trace_id=trace_id, mode=trace.mode, query=query, candidates=candidates,
                              fused=fused, signals=signals, trace_status=status,
                              trace_published=status == "published", trace_error=error,
                              route=trace.route), answer_ms

    def _observe(self, mode: str, candidates: list[Candidate], signals: Signals, seconds: float) -> None:
        m = self.metrics
        m.requests.labels(mode, "ok").inc()
        m.request_seconds.labels(mode).observe(seconds)
        if signals.contested:
            m.contested.inc()
        for c in candidates:
            m.provider_calls.labels(c.provider, "ok" if c.ok else "error").inc()
            m.provider_seconds.labels(c.provider).observe(c.latency_ms / 1000.0)
            if c.cost_usd:
                m.provider_cost.labels(c.provider).inc(c.cost_usd)


def build_gateway(settings: GatewaySettings, *, bus: Bus | None = None, providers: list[Provider] | None = None,
                  stamps: StampStore | None = None, router_client: RouterClient | None = None) -> Gateway:
    """Wire a gateway from settings; tests may hand in their own bus, providers, stamps or router client."""
    if providers is None:
        providers = [build_provider(cfg, collections_dir=settings.collections_dir,
                                    cache_dir=paths.index_dir(settings.cache_dir))
                     for cfg in settings.providers if cfg.enabled]
        if settings.drift:
            from services.providers.drift import parse_drift, with_drift

            providers = with_drift(providers, parse_drift(settings.drift))
    return Gateway(settings, bus or Bus(settings.kafka, client_id="fanroute-gateway"), providers,
                   stamps=stamps, router_client=router_client)


def create_app(settings: GatewaySettings, *, gateway: Gateway | None = None) -> FastAPI:
    """The FastAPI app; the gateway starts (indexes, Kafka) in the lifespan, before serving."""
    gw = gateway or build_gateway(settings)

    app = FastAPI(title="fanroute gateway", version="0.1.0", lifespan=lifespan_of(gw),
                  description="Fans each query out to every search provider (or to the one the router "
                              "picks, in routed mode) and records a trace.")
    app.state.gateway = gw
    app.add_middleware(BodyLimit, default=settings.max_body_bytes, prefixes={"/v1/episodes": settings.max_push_bytes},
                       on_reject=gw.metrics.rejected.labels("body_too_large").inc)

    install_contract(app, on_reject=lambda kind: gw.metrics.rejected.labels(
                         {"invalid_request": "invalid"}.get(kind, kind)).inc(),
                     body_limit=lambda path: settings.max_push_bytes if path.startswith("/v1/episodes")
                     else settings.max_body_bytes,
                     limits={"SearchRequest.query": {"maxLength": settings.max_query_chars}})

    @app.post("/v1/search", response_model=SearchResponse,
              responses={413: {"description": "Body over max_body_bytes (body_too_large)"},
                         422: {"description": "Invalid request (invalid_request) or a query over max_query_chars "
                                             "(query_too_long), with the reason"},
                         503: {"description": "Kafka did not acknowledge the trace in time and the spool is "
                                              "full or unwritable (error spool_full / spool_unavailable)"}})
    async def search(req: SearchRequest) -> Any:
        query = " ".join(req.query.split())
        if not query:
            gw.metrics.rejected.labels("empty_query").inc()
            return error_response(422, "invalid_request", "query: must not be empty or only whitespace")
        if len(req.query) > settings.max_query_chars:
            gw.metrics.rejected.labels("query_too_long").inc()
            return error_response(422, "query_too_long",
                          f"query: {len(req.query)} characters; the limit is {settings.max_query_chars}")
        t0 = time.perf_counter()
        try:
            result, answer_ms = await gw.search(req, query)
        except SpoolError as exc:
            return error_response(503, exc.kind, f"the trace was neither acknowledged by Kafka within "
                                  f"{settings.publish_wait_s:g}s nor spooled: {exc}; retry with the same request_id")
        # Serialised once here: the response model is for the docs, not re-validated per request.
        body = result.model_dump_json()
        total_ms = (time.perf_counter() - t0) * 1000.0
        slowest = max((c.latency_ms for c in result.candidates), default=0.0)
        timing = (f"{result.mode};dur={answer_ms:.3f}, slowest-provider;dur={slowest:.3f}, "
                  f"gateway;dur={total_ms - slowest:.3f}")
        return Response(body, media_type="application/json",
                        headers={TRACE_HEADER: result.trace_status,
                                 "Server-Timing": timing})

    @app.post("/v1/episodes", openapi_extra=push_body(settings), responses=PUSH_RESPONSES)
    async def push_episodes(request: Request) -> Any:
        """JSONL, one Episode per line (the ``episodes`` topic's shape); valid lines are stored."""
        return await push(gw, await request.body())

    @app.get("/healthz", responses={503: {"description": "Kafka unreachable and the spool cannot take more: "
                                                     "requests are refused (status unavailable)"}})
    async def healthz() -> JSONResponse:
        """``ok``, ``degraded`` (200, with ``reasons``) or ``unavailable`` (503): :meth:`Gateway.health`."""
        status, body = gw.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
    async def metrics() -> Response:
        if gw.metrics.multiprocess:
            gw.outbox.export_gauges()
        return prometheus(gw.metrics.exposition_registry())

    return app

