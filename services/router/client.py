"""Ask the router (the CPU sampler or vLLM, OpenAI-compatible) for an ordering of the providers.

The request is the conversation the student was trained on: the system turn built by
:func:`services.episodes.build.system_prompt` from the provider names, then the query. Greedy
decoding, a fixed ``max_tokens``, one deadline; every way this can fail is a :class:`RouterError`
with a ``kind`` the gateway counts its fallbacks by.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from services.common.errors import FanrouteError
from services.common.prompt import router_messages
from services.router.parse import ParsedOrdering, UnparseableOrdering, parse_ordering


class RouterError(FanrouteError, RuntimeError):
    """The router gave no usable ordering; ``kind`` names how (and labels the fallback metric)."""

    kind = "router_error"

    def __init__(self, message: str, *, raw: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.raw = raw  # the reply text, when there was one (an unparseable answer)
        self.status = status  # the HTTP status, when the server answered at all


class RouterTimeout(RouterError, TimeoutError):
    """No answer within the router deadline."""

    kind = "router_timeout"


class RouterUnparseable(RouterError, ValueError):
    """An answer that names no known provider."""

    kind = "unparseable"


@dataclass(frozen=True)
class RouterAnswer:
    """The parsed ordering, the reply as written, and how long asking took."""

    parsed: ParsedOrdering
    raw: str
    latency_ms: float

    @property
    def ordering(self) -> tuple[str, ...]:
        return self.parsed.ordering


def chat_request(model: str, providers: Sequence[str], query: str, max_tokens: int) -> dict[str, Any]:
    """The chat-completions body: the training conversation's system and user turns, greedy."""
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": router_messages(providers, query)}


class RouterClient:
    """One HTTP session to an OpenAI-compatible server; :meth:`route` asks it for one ordering."""

    def __init__(self, base_url: str, *, timeout_s: float = 2.0, max_tokens: int = 48,
                 api_key: str | None = None) -> None:
        if timeout_s <= 0 or max_tokens < 1:
            raise ValueError("timeout_s must be > 0 and max_tokens >= 1")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=256, limit_per_host=256))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> RouterClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def route(self, model: str, providers: Sequence[str], query: str, *,
                    timeout_s: float | None = None) -> RouterAnswer:
        """The ordering ``model`` gives ``query``; :class:`RouterError` (or a subclass) when there is none."""
        await self.start()
        assert self._session is not None
        budget = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(budget):
                async with self._session.post(f"{self.base_url}/v1/chat/completions",
                                              json=chat_request(model, providers, query, self.max_tokens)) as r:
                    body = await r.read()
                    status = r.status
        except TimeoutError:
            raise RouterTimeout(f"router {model} gave no answer within {budget:g}s") from None
        except aiohttp.ClientError as exc:
            raise RouterError(f"router {model} unreachable at {self.base_url}: {type(exc).__name__}: {exc}") from exc
        latency_ms = (time.perf_counter() - t0) * 1000.0
        raw = _content(model, status, body)
        try:
            parsed = parse_ordering(raw, providers)
        except UnparseableOrdering as exc:
            raise RouterUnparseable(str(exc), raw=raw) from exc
        return RouterAnswer(parsed, raw, round(latency_ms, 3))


def _content(model: str, status: int, body: bytes) -> str:
    """The first choice's message text, or a RouterError that says what came back instead."""
    if status != 200:
        raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RouterError(f"router {model}: not a chat completion ({type(exc).__name__}): "
                          f"{body[:200].decode(errors='replace')}", status=status) from exc
    if not isinstance(content, str):
        raise RouterError(f"router {model}: message content is {type(content).__name__}, not text", status=status)
    return content


def error_reason(body: bytes) -> str:
    """The text of an OpenAI/vLLM (``error.message`` or ``message``) or fanroute (``reason``) error body."""
    try:
        data = json.loads(body)
        err = data.get("error")
        text = err.get("message") if isinstance(err, dict) else data.get("reason") or data.get("message") or err
    except (ValueError, AttributeError):
        text = None
    return str(text) if text else body[:300].decode(errors="replace")
