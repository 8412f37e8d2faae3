"""``POST /v1/episodes``: JSONL push of episodes, answered per line (207 on partial failure)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from schemas.base import decode
from schemas.episode import Episode
from schemas.topics import topic
from services.common.errors import BusError, SchemaError

if TYPE_CHECKING:
    from services.gateway.app import Gateway


async def push(gw: Gateway, body: bytes) -> JSONResponse:
    """Store every valid line on ``episodes``; report each line's result with its number."""
    s = gw.settings
    lines = [(n, line) for n, line in enumerate(body.split(b"\n"), start=1) if line.strip()]
    if not lines:
        return _answer(400, {"error": "empty", "reason": "no episode in the body (JSONL, one per line)"})
    if len(lines) > s.max_push_lines:
        return _answer(413, {"error": "too_many_lines",
                             "reason": f"{len(lines)} episodes; the limit is {s.max_push_lines} per push"})
    results = [await _one(gw, n, line, s.max_line_bytes) for n, line in lines]
    stored = sum(r["status"] == 201 for r in results)
    status = 200 if stored == len(results) else 207 if stored else 422
    return _answer(status, {"stored": stored, "failed": len(results) - stored, "results": results})


async def _one(gw: Gateway, n: int, line: bytes, max_line_bytes: int) -> dict[str, Any]:
    if len(line) > max_line_bytes:
        return {"line": n, "status": 413, "error": f"line is {len(line)} bytes; the limit is {max_line_bytes}"}
    try:
        episode = decode(Episode, line)
    except SchemaError as exc:
        return {"line": n, "status": 422, "error": str(exc)}
    try:
        await gw.bus.publish(topic("episodes"), episode)
    except BusError as exc:
        return {"line": n, "status": 503, "error": str(exc), "episode_id": episode.episode_id}
    return {"line": n, "status": 201, "episode_id": episode.episode_id}


def _answer(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=status)
