"""Fake HTTP servers on loopback for tests (uvicorn threads, see :mod:`tests.support.serving`): one that
answers from a script and records every request, with its pytest fixtures; a fake OpenAI-compatible
router; and :func:`started` for the clients under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.serving import LoopbackServer


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


def scored_completion(scores: dict[str, float], model: str = "router@1", *, prefix_ids: Sequence[int] = (7, 8, 9),
                      shuffle: bool = False) -> Reply:
    """vLLM's ``/v1/completions`` answer to a scoring request (one prompt per name, ``prompt_logprobs=0``):
    every prompt is the same prefix tokens then one token per character of its name; the name's last
    token carries ``scores[name]`` and the others 0, as a model whose shared tokens score the same would."""
    choices = []
    for i, (name, score) in enumerate(scores.items()):
        ids = [*prefix_ids, *(ord(ch) for ch in name)]
        logprobs = [*(-0.5 for _ in prefix_ids[1:]), *(0.0 for _ in name[:-1]), score]
        entries = [None, *({str(t): {"logprob": lp, "rank": 1, "decoded_token": chr(t) if t > 31 else "?"}}
                           for t, lp in zip(ids[1:], logprobs, strict=True))]
        choices.append({"index": i, "text": " ", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                        "prompt_logprobs": entries})
    if shuffle:
        choices.reverse()
    return Reply(200, {"id": "cmpl-1", "object": "text_completion", "created": 1741570283, "model": model,
                       "choices": choices, "usage": {"prompt_tokens": 130 * len(scores),
                                                     "completion_tokens": len(scores),
                                                     "total_tokens": 131 * len(scores)}})


Answer = Callable[[str, str], str | None]


def router_app(answer: Answer, models: Sequence[str]) -> Starlette:
    """``POST /v1/chat/completions``: ``answer(model, query)`` as the content; 404 for other models;
    an ``answer`` of None is a 500."""

    async def chat(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        model = body["model"]
        if model not in models:
            return JSONResponse({"error": "model_not_found", "reason": f"The model `{model}` does not exist.",
                                 "object": "error", "message": f"The model `{model}` does not exist."}, 404)
        query = next(m["content"] for m in body["messages"] if m["role"] == "user")
        text = answer(model, query)
        if text is None:
            return JSONResponse({"error": "internal", "reason": "boom"}, 500)
        return JSONResponse({"id": "c", "object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


Score = Callable[[str, str, str], float]
_ASSISTANT = "<|im_start|>assistant\n"


def scoring_router_app(score: Score, models: Sequence[str]) -> Starlette:
    """``POST /v1/completions`` for scoring requests (one ChatML prompt per provider name,
    ``prompt_logprobs``), in vLLM's response shape: ``score(model, query, name)`` is each name's log-score."""

    async def completions(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        model = body["model"]
        if model not in models:
            return JSONResponse({"object": "error", "message": f"The model `{model}` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}, 404)
        prompts = body["prompt"]
        query = prompts[0].rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        names = [p.rsplit(_ASSISTANT, 1)[1] for p in prompts]
        return JSONResponse(scored_completion({n: score(model, query, n) for n in names}, model).body)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def router_server(answer: Answer, models: Sequence[str]) -> LoopbackServer:
    return LoopbackServer(router_app(answer, models), name="fake-router")
