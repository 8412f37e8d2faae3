"""Loopback search providers with fixed latencies, speaking SearXNG's JSON format.

``python bench/synthetic_providers.py PORT 20 35 50`` serves ``/p0/search`` (20 ms),
``/p1/search`` (35 ms) and ``/p2/search`` (50 ms). Used by the gateway benchmarks.
``--snippet-chars N`` gives every result N characters of text (default 16, "synthetic result"); the
demo market's citations carry 483 on average (at most 600, what the judge reads).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def make_app(latencies_ms: list[float], snippet_chars: int = 16) -> Starlette:
    words = "synthetic result text of a document about retrieval and routing ".split()
    text = " ".join(words[i % len(words)] for i in range(snippet_chars))[:snippet_chars]

    async def search(request: Request) -> Response:
        i = int(request.path_params["i"])
        q = request.query_params.get("q", "")
        await asyncio.sleep(latencies_ms[i] / 1000.0)
        seed = int(hashlib.sha256(f"{i}:{q}".encode()).hexdigest()[:8], 16)
        results = [{"url": f"https://example.org/doc/{(seed + j * 7919) % 500}", "title": f"doc {j}",
                    "content": text, "engine": f"p{i}", "score": 1.0 / (j + 1)}
                   for j in range(10)]
        body = json.dumps({"query": q, "number_of_results": 10, "results": results, "answers": [],
                           "suggestions": [], "unresponsive_engines": []})
        return Response(body, media_type="application/json")

    return Starlette(routes=[Route("/p{i:int}/search", search)])


if __name__ == "__main__":
    args = sys.argv[1:]
    chars = 16
    if "--snippet-chars" in args:
        at = args.index("--snippet-chars")
        chars = int(args[at + 1])
        del args[at:at + 2]
    port, lat = int(args[0]), [float(x) for x in args[1:]]
    uvicorn.run(make_app(lat, chars), host="127.0.0.1", port=port, log_level="warning", access_log=False)
