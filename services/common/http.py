"""HTTP pieces every FastAPI service shares: the error body, the request-body limit, the lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi.responses import JSONResponse


def error(status: int, kind: str, reason: str) -> JSONResponse:
    """The one error body of fanroute's HTTP APIs: ``{"error": kind, "reason": ...}``."""
    return JSONResponse({"error": kind, "reason": reason}, status_code=status)


def lifespan_of(service: Any) -> Callable[[Any], Any]:
    """A FastAPI lifespan: ``await service.start()`` before serving, ``await service.stop()`` after."""

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    return lifespan


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over its path's limit, before or while reading it.

    ``prefixes`` maps a path prefix to its own limit (first match wins); ``on_reject`` counts;
    ``render(status, kind, reason)`` writes the refusal in the service's own error body (default
    :func:`error`), so that a 413 has the same fields as the service's other errors.
    """

    def __init__(self, app: Any, *, default: int, prefixes: dict[str, int] | None = None,
                 on_reject: Callable[[], None] = lambda: None,
                 render: Callable[[int, str, str], Any] = error) -> None:
        self.app, self.default, self.prefixes, self.on_reject = app, default, prefixes or {}, on_reject
        self.render = render

    def _limit(self, path: str) -> int:
        return next((n for p, n in self.prefixes.items() if path.startswith(p)), self.default)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self._limit(scope.get("path", ""))
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            return await self._refuse(max_bytes)(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > max_bytes:
                raise _TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(max_bytes)(scope, receive, send)

    def _refuse(self, max_bytes: int) -> Any:
        self.on_reject()
        return self.render(413, "body_too_large", f"request body over {max_bytes} bytes")


class _TooLarge(Exception):
    pass
