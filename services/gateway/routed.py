"""Routed mode: the promoted router orders the providers and only the top one is called (the next on
failure); the best single provider answers whenever the router cannot.

A bad router answer never reaches the caller as an error: every way asking can fail is a fallback
with its reason on the trace and in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from schemas.trace import Candidate, Route, RouteFallback, Trace
from services.common.bus import Bus
from services.common.stamps import RedisStampStore, StampStore
from services.gateway.follow import Promoted, PromotedFollower
from services.gateway.metrics import GatewayMetrics
from services.gateway.settings import GatewaySettings, RoutingSettings
from services.providers.base import Provider
from services.providers.fanout import call_provider
from services.providers.signals import compute_signals
from services.router.client import RouterAnswer, RouterClient, RouterError
from services.router.linear_client import LinearRouterClient
from services.router.policy import call_order, in_fanout_slice
from services.router.scoring import decide

log = logging.getLogger(__name__)
FALLBACK_REASONS: tuple[RouteFallback, ...] = ("no_adapter", "router_timeout", "router_error", "unparseable")
RAW_LIMIT = 4096


def router_client(r: RoutingSettings) -> RouterClient | LinearRouterClient:
    """The client of the configured router kind: HTTP to the model server, or the linear router in-process."""
    if r.kind == "linear":
        assert r.publisher_url is not None, "settings validation requires publisher_url with kind linear"
        return LinearRouterClient(r.publisher_url, timeout_s=r.router_timeout_s)
    assert r.router_url is not None, "settings validation requires router_url when routing is enabled"
    return RouterClient(r.router_url, timeout_s=r.router_timeout_s, max_tokens=r.max_tokens, mode=r.mode,
                        prompt_format=r.prompt_format, prompt_logprobs=r.prompt_logprobs,
                        rates_from=r.publisher_url if r.decision == "top-tier" else None)


class RoutedMode:
    """The follower of the promoted version, the router client and the per-request routing decision."""

    def __init__(self, settings: GatewaySettings, providers: list[Provider], bus: Bus, metrics: GatewayMetrics,
                 *, stamps: StampStore | None = None, client: RouterClient | None = None) -> None:
        r = settings.routing
        self.routing = r
        self.contested_threshold = settings.contested_threshold
        self.deadline_s = settings.deadline_s
        self.providers = {p.name: p for p in providers}
        self.names = list(self.providers)
        self.metrics = metrics
        if stamps is None and settings.redis.url != "memory://":
            stamps = RedisStampStore(settings.redis.url, settings.kafka.topic_namespace)
        self.follower = PromotedFollower(r.model_id, bus, stamps=stamps, poll_s=r.poll_s,
                                         group_id=r.consumer_group, on_change=self._promoted)
        self.client = client or router_client(r)
        if r.kind == "lm" and r.decision == "top-tier" and r.publisher_url is None:
            log.warning("routing.decision top-tier pulls each adapter's top-tier table from routing.publisher_url, "
                        "which is not set: the router decides by the first choice")
        self.cost_usd = {p.name: p.cost_usd for p in providers}
        self._fallback_logged: tuple[str, str] | None = None
        self._prefetch: asyncio.Task[None] | None = None
        self._last_outcome: str | None = None
        for path in ("router", "fallback"):
            metrics.routed.labels(path)
        for reason in FALLBACK_REASONS:
            metrics.route_fallbacks.labels(reason)

    def subscribe(self) -> None:
        """Follow the adapters topic; call before the bus starts."""
        self.follower.subscribe()

    async def start(self) -> None:
        await self.client.start()
        await self.follower.start()
        self.fallback_provider(self.follower.current)  # logs which provider the fallback is

    async def stop(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
        await self.follower.stop()
        await self.client.close()

    def fans_out(self, key: str) -> bool:
        """Whether the request with this key is in the slice that keeps fanning out."""
        return in_fanout_slice(key, self.routing.fanout_fraction)

    def fallback_provider(self, promoted: Promoted | None) -> str:
        """The configured best single provider, else the promotion's, else the first enabled one."""
        if self.routing.fallback_provider is not None:
            name, why = self.routing.fallback_provider, "configured"
        elif promoted is not None and promoted.fallback_provider in self.providers:
            name, why = promoted.fallback_provider, f"measured with {promoted.router}"
        else:
            name, why = self.names[0], "the first enabled provider"
            if promoted is not None and promoted.fallback_provider is not None:
                why += f"; {promoted.router}'s {promoted.fallback_provider!r} is not a provider here"
        if self._fallback_logged != (name, why):
            self._fallback_logged = (name, why)
            log.info("routed fallback provider: %s (%s)", name, why)
        return name

    def describe(self) -> dict[str, object]:
        """Routing state for /healthz."""
        promoted = self.follower.current
        return {"enabled": True, "model_id": self.routing.model_id,
                "version": promoted.version if promoted else None,
                "router": promoted.router if promoted else None,
                "fallback_provider": self.fallback_provider(promoted),
                "fanout_fraction": self.routing.fanout_fraction}

    async def trace(self, query: str, *, trace_id: str, query_id: str | None) -> Trace:
        """Ask the router, call providers in its order until one answers, and record it as a routed trace."""
        received = datetime.now(UTC)
        deadline_at = asyncio.get_running_loop().time() + self.deadline_s
        promoted = self.follower.current
        answer, reason, raw, router_ms = await self._ask(promoted, query)
        fallback = self.fallback_provider(promoted)
        scores = answer.scores if answer is not None and answer.scores is not None else None
        rates = answer.rates if answer is not None and self.routing.decision == "top-tier" else None
        if scores is not None:
            ordering = decide(scores, self.cost_usd, self.routing.cost_weight, rates)
        else:
            ordering = answer.ordering if answer is not None else ()
        candidates = await self._call_in_order(call_order(ordering, self.names, fallback), query, deadline_at)
        route = Route(router=promoted.router if promoted else None, ordering=ordering,
                      router_sha256=answer.adapter_sha256 if answer is not None else None,
                      called=tuple(c.provider for c in candidates), fallback=reason,
                      fallback_provider=fallback if reason else None, router_ms=router_ms, raw=raw[:RAW_LIMIT],
                      scores=scores or {}, cost_weight=self.routing.cost_weight if scores is not None else None,
                      decision=(("top-tier" if rates is not None else "first-choice") if scores is not None else None))
        self._count(reason)
        # One answering candidate at most, so nothing to disagree about: routed traces are never contested.
        signals = compute_signals(candidates, self.contested_threshold).model_copy(update={"contested": False})
        return Trace(trace_id=trace_id, received_at=received, query=query, query_id=query_id, mode="routed",
                     router_version=route.router, route=route, candidates=tuple(candidates), signals=signals)

    async def _ask(self, promoted: Promoted | None,
                   query: str) -> tuple[RouterAnswer | None, RouteFallback | None, str, float]:
        """(answer, fallback reason, reply text, ms spent asking); exactly one of answer and reason is set."""
        if promoted is None:
            return None, "no_adapter", "", 0.0
        t0 = time.perf_counter()
        reason: RouteFallback
        raw = ""
        try:
            answer = await self.client.route(promoted.router, self.names, query)
        except RouterError as exc:
            reason, raw = exc.kind, exc.raw  # type: ignore[assignment]  # kinds are RouteFallback values
            self._note(reason, f"{reason}: {exc}")
        except Exception as exc:  # a client bug must not fail the request; CancelledError is not caught
            log.exception("asking router %s raised unexpectedly", promoted.router)
            reason = "router_error"
            self._note(reason, f"{type(exc).__name__}: {exc}")
        else:
            self.metrics.router_seconds.observe(answer.latency_ms / 1000.0)
            self._note("router", "answering again")
            return answer, None, answer.raw, answer.latency_ms
        ms = round((time.perf_counter() - t0) * 1000.0, 3)
        self.metrics.router_seconds.observe(ms / 1000.0)
        return None, reason, raw, ms

    async def _call_in_order(self, order: list[str], query: str, deadline_at: float) -> list[Candidate]:
        """Call ``order`` one at a time, up to ``max_attempts``, until a candidate is ok or time is up."""
        out: list[Candidate] = []
        loop = asyncio.get_running_loop()
        for name in order[:self.routing.max_attempts]:
            if out:
                if loop.time() >= deadline_at:
                    break
                self.metrics.route_failovers.inc()
            out.append(await self._call_before(self.providers[name], query, deadline_at))
            if out[-1].ok:
                break
        return out

    async def _call_before(self, provider: Provider, query: str, deadline_at: float) -> Candidate:
        """One provider call, cut off at the request's deadline (its own timeout still applies)."""
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline_at):
                return await call_provider(provider, query)
        except TimeoutError:
            return Candidate(provider=provider.name, latency_ms=round((time.perf_counter() - t0) * 1000.0, 3),
                             cost_usd=0.0, error=f"gateway deadline of {self.deadline_s:g}s exceeded",
                             error_kind="deadline")

    def _count(self, reason: RouteFallback | None) -> None:
        self.metrics.routed.labels("fallback" if reason else "router").inc()
        if reason:
            self.metrics.route_fallbacks.labels(reason).inc()

    async def _prepare(self, router: str) -> None:
        try:
            await self.client.prepare(router)  # type: ignore[union-attr]
        except RouterError as exc:  # the requests will fall back and say why; log it once here
            log.warning("could not load %s: %s", router, exc)

    def _note(self, outcome: str, message: str) -> None:
        """Log when the router's outcome changes (not per request: a router that is down would flood)."""
        previous, self._last_outcome = self._last_outcome, outcome
        if outcome != previous and (outcome != "router" or previous is not None):
            (log.info if outcome == "router" else log.warning)("router %s", message)

    def _promoted(self, promoted: Promoted) -> None:
        self.metrics.router_version.set(promoted.version)
        if isinstance(self.client, LinearRouterClient) or getattr(self.client, "rates", None) is not None:
            try:  # pull it (or its top-tier table) now, not on the first routed request
                self._prefetch = asyncio.get_running_loop().create_task(self._prepare(promoted.router))
            except RuntimeError:  # no loop (a promotion read at start-up): the first request pulls it
                pass
