"""Real HTTP servers on loopback for tests: a uvicorn thread, one that answers from a script, and a
uvicorn task in the test's own event loop (for services that share the loop with the test); the
pytest fixtures of a scripted server, and :func:`started` for the clients under test.

The listening socket is bound before uvicorn starts, so connections simply queue until uvicorn
accepts them (after the app's lifespan start-up): no start-up wait, no sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def loopback_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1:<free port> (``getsockname()[1]`` is the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class LoopbackServer:
    """A Starlette app served by uvicorn in a background thread on 127.0.0.1:<free port>."""

    def __init__(self, app: Starlette, name: str = "fake-http") -> None:
        self._sock = loopback_socket()
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=name, daemon=True)

    def url(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class InLoopServer:
    """An ASGI app served by uvicorn as a task of the running loop, on a socket bound beforehand;
    ``async with`` it, or :meth:`stop` it early (then connections to it are refused)."""

    def __init__(self, app: Any, sock: socket.socket | None = None) -> None:
        self.sock = sock or loopback_socket()
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InLoopServer:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]), name=f"serve:{self.port}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            task, self._task = self._task, None
            try:
                await task
            finally:
                self.sock.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@dataclass
class Reply:
    """One scripted answer: status, JSON body (or raw bytes), headers and an optional delay."""

    status: int = 200
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0

    def encode(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


@dataclass
class Received:
    """One request as the server saw it."""

    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        """The body as JSON (None when there is no body)."""
        return json.loads(self.raw) if self.raw else None


class ScriptedServer(LoopbackServer):
    """Answers each path with the replies queued for it, in order, and records every request."""

    def __init__(self, name: str = "scripted-http") -> None:
        self.received: list[Received] = []
        self.arrived = threading.Event()
        self._script: dict[str, deque[Reply]] = {}
        self._lock = threading.Lock()
        super().__init__(Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])]),
                         name)

    def script(self, path: str, *replies: Reply) -> None:
        """Queue ``replies`` for ``path`` (answered in order, one per request)."""
        with self._lock:
            self._script.setdefault(path, deque()).extend(replies)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self.received.clear()
        self.arrived.clear()

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        with self._lock:
            self.received.append(Received(request.method, request.url.path, dict(request.query_params),
                                          dict(request.headers), raw))
            queue = self._script.get(request.url.path)
            reply = queue.popleft() if queue else Reply(599, {"fake": "no reply scripted"})
        self.arrived.set()
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        return Response(reply.encode(), status_code=reply.status, headers=reply.headers,
                        media_type=reply.content_type)


S = TypeVar("S", bound=ScriptedServer)


def scripted_fixtures(make: Callable[[], S]) -> tuple[Any, Any]:
    """The pytest fixtures ``server`` (one ``make()`` server, started once per module) and ``fake``
    (that server, reset for each test); assign them in the test module: ``server, fake = ...``."""

    @pytest.fixture(scope="module", name="server")
    def server() -> Iterator[S]:
        fake = make()
        fake.start()
        yield fake
        fake.stop()

    @pytest.fixture(name="fake")
    def fake(server: S) -> S:
        server.reset()
        return server

    return server, fake


class Startable(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=Startable)


@contextlib.asynccontextmanager
async def started(client: C) -> AsyncIterator[C]:
    """``await client.start()``, then ``await client.close()`` however the block ends."""
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def chat_completion(content: str | None, model: str = "router@1") -> Reply:
    """An OpenAI chat-completions answer whose first choice says ``content`` (the CPU sampler's and vLLM's shape)."""
    return Reply(200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 1741570283, "model": model,
                       "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                    "message": {"role": "assistant", "content": content}}],
                       "usage": {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129}})
