"""Asking the candidate and deployed routers about every held-out query (and checking they exist first)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from schemas.trace import Trace
from services.common.progress import gather_bounded
from services.evaluate.inputs import EvalInputError
from services.evaluate.policies import RouterCall
from services.router.client import RouterClient, RouterError, RouterMode, RouterUnparseable

_SERVED = re.compile(r"^(?P<model_id>[^@\s]+)(?:@(?P<version>\d+))?$")
#: Generous: a sampler fetches an adapter it does not hold yet from the publisher before answering.
PROBE_TIMEOUT_S = 120.0


def split_served_name(name: str) -> tuple[str, int | None]:
    """``router@3`` → (``router``, 3); ``router`` → (``router``, None); anything else is bad input."""
    m = _SERVED.match(name)
    if m is None:
        raise EvalInputError(f"{name!r} is not a served adapter name (<model_id> or <model_id>@<version>)")
    return m["model_id"], int(m["version"]) if m["version"] else None


async def probe(router_url: str, model: str, providers: Sequence[str], query: str, *,
                mode: RouterMode = "generate") -> None:
    """One 1-token request: an unknown adapter (the server's 404) or an unreachable server is bad input."""
    async with RouterClient(router_url, timeout_s=PROBE_TIMEOUT_S, max_tokens=1, mode=mode) as client:
        try:
            await client.route(model, providers, query)
        except RouterUnparseable:
            return  # one token names no provider: the adapter is there, which is all this asks
        except RouterError as exc:
            if exc.status is None:
                raise EvalInputError(f"router server unreachable at {router_url}: {exc}") from exc
            if exc.status == 404:
                raise EvalInputError(f"the router server at {router_url} does not serve {model!r} (404): "
                                     f"{exc}") from exc


async def ask_all(client: RouterClient, model: str, traces: Sequence[Trace], *, concurrency: int = 1,
                  progress: bool = True) -> dict[str, RouterCall]:
    """trace id → what ``model`` answered for that trace's query over that trace's providers.

    ``router_ms`` is measured around each call (a failure costs the time until it failed).
    """
    async def one(t: Trace) -> tuple[str, RouterCall]:
        t0 = time.perf_counter()
        try:
            answer = await client.route(model, [c.provider for c in t.candidates], t.query)
        except RouterError as exc:
            return t.trace_id, RouterCall(error_kind=exc.kind, router_ms=_ms(t0), raw=getattr(exc, "raw", ""),
                                          error=str(exc))
        return t.trace_id, RouterCall(ordering=answer.ordering, router_ms=_ms(t0), raw=answer.raw,
                                      scores=answer.scores, rates=answer.rates)

    return dict(await gather_bounded(one, traces, concurrency=concurrency, desc=f"route {model}", unit="q",
                                     progress=progress))


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)
