"""Send one query to every provider at once, each under its own timeout and one overall deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from schemas.trace import Candidate, Trace
from services.common.errors import ProviderError, ProviderTimeout
from services.providers.base import Provider

log = logging.getLogger(__name__)


async def call_provider(provider: Provider, query: str) -> Candidate:
    """One provider call turned into a candidate; a failure is a candidate with its error."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(provider.timeout_s):
            answer = await provider.search(query)
    except TimeoutError:
        err: ProviderError = ProviderTimeout(provider.name, f"no answer within {provider.timeout_s:g}s")
    except ProviderError as exc:
        err = exc
    except Exception as exc:  # a provider bug must not fail the request; it is recorded instead
        log.exception("provider %s raised unexpectedly", provider.name)
        err = ProviderError(provider.name, f"internal error: {type(exc).__name__}: {exc}")
        err.kind = "internal"
    else:
        return Candidate(provider=provider.name, answer=answer.answer, citations=answer.citations,
                         latency_ms=_ms_since(t0), cost_usd=answer.cost_usd)
    return Candidate(provider=provider.name, latency_ms=_ms_since(t0), cost_usd=0.0,
                     error=err.message, error_kind=err.kind)


async def fan_out(providers: list[Provider], query: str, *, deadline_s: float) -> list[Candidate]:
    """Every provider concurrently; whatever is unfinished at the deadline becomes a deadline error."""
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(call_provider(p, query), name=f"provider:{p.name}") for p in providers]
    try:
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    out = []
    for p, t in zip(providers, tasks):
        if t in done:
            out.append(t.result())
        else:
            out.append(Candidate(provider=p.name, latency_ms=_ms_since(t0), cost_usd=0.0,
                                 error=f"gateway deadline of {deadline_s:g}s exceeded",
                                 error_kind="deadline"))
    return out


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


async def fan_out_trace(providers: list[Provider], query: str, *, trace_id: str, deadline_s: float,
                        contested_threshold: float, query_id: str | None = None) -> Trace:
    """One fan-out as a Trace (candidates + signals): what the gateway publishes."""
    from services.providers.signals import compute_signals

    received = datetime.now(UTC)
    candidates = await fan_out(providers, query, deadline_s=deadline_s)
    return Trace(trace_id=trace_id, received_at=received, query=query, query_id=query_id, mode="fanout",
                 candidates=tuple(candidates), signals=compute_signals(candidates, contested_threshold))

