"""Trace ids: what identifies a request, hashed, so a retry gets the same id and nothing else does."""

from __future__ import annotations

import uuid

from schemas.base import content_id


def trace_id_for(request_id: str | None, query: str, query_id: str | None) -> str:
    """The trace id of one search request.

    With a ``request_id``: the content id of the request id *and* the (whitespace-normalised) query and
    ``query_id``, so a retried request (same three) yields the same trace id, and a reused request id with
    another query (or query id) yields a different one instead of colliding with, and being deduplicated
    into, an unrelated trace. Without one: a random id (every request is a new trace).
    """
    if request_id is None:
        return uuid.uuid4().hex
    return content_id("trace", request_id, query, query_id)


__all__ = ["trace_id_for"]
