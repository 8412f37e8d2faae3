"""A fake router: an OpenAI-compatible ``POST /v1/chat/completions`` that orders the providers named
in the system turn, with a seeded log-normal latency and configurable shares of bad answers.

Each request draws from its own RNG seeded by (seed, model, query), so a query gets the same answer,
latency and outcome whatever the arrival order. Outcomes, in this order of the draw:

* ``error``: HTTP 500 after the latency (the gateway's ``router_error`` fallback);
* ``bad``: garbage text naming no provider (``unparseable``);
* ``slow``: a good answer, but only after ``slow_ms`` (past the router deadline: ``router_timeout``);
* otherwise a good answer, ``p1 > p0 > p2`` (a permutation drawn per query), after the latency.

``GET /stats`` returns the counters; ``GET /v1/models`` and ``GET /health`` answer like the sampler.

    python bench/fake_router.py 8001 --median-ms 40 --sigma 0.5 --bad 0.02 --slow 0.02 --error 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass

from aiohttp import web

PROVIDERS_RE = re.compile(r"The providers are: (.+?)\.\n")
GARBAGE = ("I am not sure which search engine fits this query.", "```\n\n```", "<think>hmm</think> none",
           "As an AI language model, I cannot browse the web.", "1. 2. 3.")


@dataclass(frozen=True)
class RouterBehaviour:
    """Latency distribution and outcome shares of the fake router."""

    median_ms: float = 40.0
    sigma: float = 0.5
    bad: float = 0.02
    slow: float = 0.02
    slow_ms: float = 2000.0
    error: float = 0.01
    seed: int = 0
    providers: tuple[str, ...] = ()  # when the system turn names none

    def __post_init__(self) -> None:
        if min(self.bad, self.slow, self.error) < 0 or self.bad + self.slow + self.error > 1:
            raise ValueError("bad, slow and error shares must be >= 0 and sum to at most 1")
        if self.median_ms < 0 or self.sigma < 0 or self.slow_ms < 0:
            raise ValueError("median_ms, sigma and slow_ms must be >= 0")

    def describe(self) -> str:
        return (f"fake (latency median {self.median_ms:g} ms sigma {self.sigma:g}; bad {self.bad:.0%}, "
                f"slow {self.slow:.0%} at {self.slow_ms:g} ms, error {self.error:.0%})")


def completion(content: str, model: str) -> dict:
    """An OpenAI chat-completions body whose first choice says ``content``."""
    return {"id": f"chatcmpl-{time.time_ns():x}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129}}


def decide(b: RouterBehaviour, model: str, query: str, providers: list[str]) -> tuple[str, float, str]:
    """(outcome, latency in s, content) for one request; deterministic in (seed, model, query)."""
    rng = random.Random(f"{b.seed}:{model}:{query}")
    u = rng.random()
    latency = b.median_ms * math.exp(b.sigma * rng.gauss(0.0, 1.0)) / 1000.0
    order = list(providers)
    rng.shuffle(order)
    good = " > ".join(order)
    if u < b.error:
        return "error", latency, ""
    if u < b.error + b.bad:
        return "bad", latency, rng.choice(GARBAGE)
    if u < b.error + b.bad + b.slow:
        return "slow", b.slow_ms / 1000.0, good
    return "ok", latency, good


def make_app(b: RouterBehaviour) -> web.Application:
    stats: Counter[str] = Counter()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        model = str(body.get("model", ""))
        messages = body.get("messages") or []
        system = next((m.get("content", "") for m in messages if m.get("role") == "system"), "")
        query = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
        m = PROVIDERS_RE.search(system)
        providers = [p.strip() for p in m.group(1).split(",")] if m else list(b.providers)
        outcome, latency, content = decide(b, model, query, providers or ["none"])
        stats["requests"] += 1
        stats[outcome] += 1
        await asyncio.sleep(latency)  # a client past its deadline has gone; the write is then dropped
        if outcome == "error":
            return web.json_response({"error": {"message": "fake router overloaded", "type": "server_error"}},
                                     status=500)
        return web.json_response(completion(content, model))

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response({**dict(stats), "behaviour": asdict(b)})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/stats", get_stats),
                    web.get("/v1/models", models), web.get("/health", health)])
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("port", type=int)
    p.add_argument("--median-ms", type=float, default=RouterBehaviour.median_ms)
    p.add_argument("--sigma", type=float, default=RouterBehaviour.sigma, help="log-normal shape (0 = constant)")
    p.add_argument("--bad", type=float, default=RouterBehaviour.bad, help="share of garbage answers")
    p.add_argument("--slow", type=float, default=RouterBehaviour.slow, help="share answered after --slow-ms")
    p.add_argument("--slow-ms", type=float, default=RouterBehaviour.slow_ms)
    p.add_argument("--error", type=float, default=RouterBehaviour.error, help="share of HTTP 500 answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--providers", default="", help="comma-separated names, when the system turn names none")
    a = p.parse_args()
    b = RouterBehaviour(median_ms=a.median_ms, sigma=a.sigma, bad=a.bad, slow=a.slow, slow_ms=a.slow_ms,
                        error=a.error, seed=a.seed, providers=tuple(x for x in a.providers.split(",") if x))
    web.run_app(make_app(b), host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
