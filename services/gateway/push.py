"""``POST /v1/episodes``: JSONL push of episodes, answered per line (207 on partial failure)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from schemas.base import decode
from schemas.episode import Episode
from schemas.topics import topic
from services.common.errors import BusError, SchemaError
from services.common.openapi import errors, inline_schema

if TYPE_CHECKING:
    from services.gateway.app import Gateway
    from services.gateway.settings import GatewaySettings

NDJSON = "application/x-ndjson"


class LineResult(BaseModel):
    """What became of one line: 201 stored (with its episode id), 413, 422 or 503 with the reason."""

    line: int = Field(description="1-based line number in the body")
    status: int = Field(description="201 stored; 413 line too long; 422 not an episode; 503 Kafka did not ack")
    episode_id: str | None = None
    error: str | None = Field(default=None, description="Why the line was not stored")


class PushResult(BaseModel):
    """How many lines were stored, how many failed, and each line's result."""

    stored: int
    failed: int
    results: list[LineResult]


#: ``responses=`` of the push route.
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Every line stored", "model": PushResult},
    207: {"description": "Some lines stored; a result per line with its status and reason", "model": PushResult},
    422: {"description": "No line was stored; a result per line with its status and reason", "model": PushResult},
    **errors({400: "No episode in the body (empty)",
              413: "Too many bytes (body_too_large) or lines (too_many_lines)"})}


def request_body(settings: GatewaySettings) -> dict[str, Any]:
    """``openapi_extra`` of the push route: the JSONL body, one Episode per line, with its limits."""
    episode = inline_schema(Episode, required=("schema_version",))
    return {"requestBody": {"required": True, "description": (
        f"JSONL: one Episode (the episodes topic's shape, schema_version required) per line; blank lines "
        f"are skipped. At most {settings.max_push_lines} episodes and {settings.max_push_bytes} bytes per "
        f"push, {settings.max_line_bytes} bytes per line. The body is read as JSONL whatever its "
        f"Content-Type; described here as an array, one item per line."),
        "content": {NDJSON: {"schema": {"type": "array", "items": episode, "minItems": 1,
                                        "maxItems": settings.max_push_lines}}}}}


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
        # Strictly as documented too: no coercion (false is not a token id, 0 is not a date).
        Episode.model_validate_json(line, strict=True)
    except SchemaError as exc:
        return {"line": n, "status": 422, "error": str(exc)}
    except ValidationError as exc:
        return {"line": n, "status": 422, "error": f"Episode: {_first_error(exc)}"}
    try:
        await gw.bus.publish(topic("episodes"), episode)
    except BusError as exc:
        return {"line": n, "status": 503, "error": str(exc), "episode_id": episode.episode_id}
    return {"line": n, "status": 201, "episode_id": episode.episode_id}


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"


def _answer(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=status)
