"""The least a Python search proxy can do: one inbound request, the same three provider calls, a JSON answer.

``python bench/plain_proxy.py PORT PROVIDERS_PORT N`` serves ``POST /v1/search`` on the stack the
gateway uses (uvicorn with httptools, Starlette, aiohttp, the standard JSON module): it fans the query
out to ``/p0 … /p{N-1}`` and answers the providers' results with each call's latency, in the shape
``bench/gateway_overhead.py`` reads. No validation, no trace, no bus, no metrics: the gap between it
and the plain in-process fan-out is what any proxy process costs on shared cores; the gap between it
and the gateway is what fanroute itself adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def make_app(providers_port: int, n: int) -> Starlette:
    state: dict[str, aiohttp.ClientSession] = {}

    async def call(i: int, q: str) -> dict:
        t = time.perf_counter()
        async with state["http"].get(f"http://127.0.0.1:{providers_port}/p{i}/search",
                                     params={"q": q, "format": "json"}) as r:
            body = await r.json()
        return {"provider": f"p{i}", "results": body["results"], "latency_ms": (time.perf_counter() - t) * 1000}

    async def search(request: Request) -> Response:
        t = time.perf_counter()
        q = (await request.json())["query"]
        candidates = await asyncio.gather(*(call(i, q) for i in range(n)))
        slowest = max(c["latency_ms"] for c in candidates)
        body = json.dumps({"query": q, "candidates": candidates, "trace_status": "published"})
        spent = (time.perf_counter() - t) * 1000 - slowest
        return Response(body, media_type="application/json", headers={"Server-Timing": f"gateway;dur={spent:.3f}"})

    async def healthz(request: Request) -> Response:
        return Response("ok")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:
            state["http"] = http
            yield

    return Starlette(routes=[Route("/v1/search", search, methods=["POST"]), Route("/healthz", healthz)],
                     lifespan=lifespan)


if __name__ == "__main__":
    port, providers_port, n = (int(x) for x in sys.argv[1:4])
    uvicorn.run(make_app(providers_port, n), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="asyncio", http="httptools")
