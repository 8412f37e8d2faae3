"""A retrying async HTTP client for the third-party JSON APIs fanroute calls (web search, LLM judges).

What every such caller needs, so that each API client only builds its request and reads its reply:

* :class:`RetryingClient`: one ``aiohttp.ClientSession`` on a base URL. :meth:`RetryingClient.send`
  makes one exchange and reads it in full into an :class:`HttpReply`; a failure below HTTP comes
  out as a :class:`TransportError` whose :class:`Failure` kind classifies it (timeout, cannot
  connect, connection broken mid-exchange, anything else), with no aiohttp exception chained.
* :func:`with_retries`: the attempt loop. An attempt raises :class:`AttemptFailed` to say whether
  another attempt may help and how long the server asked to wait; :class:`Backoff` turns that into
  a delay; the loop stops after ``attempts`` or before a wait would cross the ``deadline``.
* :func:`is_transient_status`, :func:`retry_after_s` (Retry-After in seconds or as an HTTP date),
  :func:`error_reason` (a short reason for a non-2xx reply), :func:`one_line`.
* Key redaction: :func:`redact` blanks secrets (raw or URL-encoded) out of text, and a
  :class:`SecretFilter` on a logger does it for every log line (and masks query parameters).
* :class:`KeyedApi`: the start/close lifecycle of one client behind an optional API key.

aiohttp rather than httpx: on the gateway's hot path httpx cost ~3x the CPU per call (its pool
slows down badly with many requests in flight, and it re-parses URLs per request); measured
with bench/gateway_overhead.py.
"""

from __future__ import annotations

import asyncio
import email.utils
import enum
import itertools
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote, quote_plus

import aiohttp
from yarl import URL

from schemas.base import fast_loads
from services.common.errors import ConfigError
from services.common.settings import secret_value

__all__ = [
    "AttemptFailed", "Backoff", "Failure", "HttpReply", "KeyedApi", "RetryingClient", "SecretFilter",
    "TransportError", "classify", "error_reason", "is_transient_status", "one_line", "redact",
    "retry_after_s", "with_retries",
]

T = TypeVar("T")

_SPACE = re.compile(r"\s+")
_TAG = re.compile(r"<[^>]*>")


# ---- replies and failures -------------------------------------------------------------------


@dataclass(frozen=True)
class HttpReply:
    """One HTTP answer, read in full."""

    status: int
    reason: str
    headers: Mapping[str, str]
    content: bytes

    @property
    def ok(self) -> bool:
        """Whether the status is 2xx."""
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` when it is not."""
        return fast_loads(self.content)

    def json_or_none(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return self.json()
        except ValueError:
            return None


class Failure(enum.Enum):
    """What kind of failure below HTTP an exchange met (see :class:`TransportError`)."""

    #: No answer in time (aiohttp's connect and read timeouts included).
    TIMEOUT = "timeout"
    #: The connection could not be made (refused, DNS, TLS handshake, proxy).
    CONNECT = "connect"
    #: The connection broke or the body could not be read, after it was made.
    BROKEN = "broken"
    #: Any other client-side failure (bad URL, too many redirects, ...).
    OTHER = "other"


class TransportError(Exception):
    """One exchange failed below HTTP; ``kind`` says how, ``type_name`` is the aiohttp error's class.

    ``detail`` is that error's text with the client's registered secrets blanked out; the
    aiohttp exception (which knows the URL) is never chained.
    """

    def __init__(self, kind: Failure, type_name: str, detail: str) -> None:
        super().__init__(f"{type_name}: {detail}")
        self.kind = kind
        self.type_name = type_name
        self.detail = detail


def classify(exc: BaseException) -> Failure | None:
    """The :class:`Failure` kind of an exception an aiohttp exchange raised; None for others."""
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError and ConnectionTimeoutError too
        return Failure.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Failure.CONNECT
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
        return Failure.BROKEN
    if isinstance(exc, aiohttp.ClientError):
        return Failure.OTHER
    return None


def is_transient_status(status: int, statuses: Iterable[int] = (429,)) -> bool:
    """Whether an HTTP error status may pass on another attempt: one of ``statuses``, or any 5xx."""
    return status >= 500 or status in statuses


# ---- the client -----------------------------------------------------------------------------


class RetryingClient:
    """One ``aiohttp.ClientSession`` on ``base_url``; open it inside the event loop, close it once.

    ``headers`` go on every request (``Accept: application/json`` unless overridden);
    ``timeout_s`` bounds one exchange, connect to last byte; ``connections`` caps the pool (in
    total and per host; aiohttp's default when None). With ``log``, every exchange is logged at
    DEBUG as ``HTTP Request: METHOD URL -> STATUS`` with ``secrets`` masked in the query.
    """

    def __init__(self, base_url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None,
                 connections: int | None = None, secrets: SecretFilter | None = None,
                 log: logging.Logger | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.secrets = secrets or SecretFilter()
        self._log = log
        connector = (aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
                     if connections else None)
        self._session = aiohttp.ClientSession(
            headers={"Accept": "application/json", **(headers or {})}, connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_s), raise_for_status=False)

    async def close(self) -> None:
        """Close the session and its connections."""
        await self._session.close()

    async def send(self, method: str, path: str, *, params: Mapping[str, str | int] | None = None,
                   json: Any = None, timeout_s: float | None = None) -> HttpReply:
        """One exchange on ``base + path``, read in full; :class:`TransportError` below HTTP.

        ``timeout_s`` overrides the client's timeout for this exchange (at least 1 ms).
        """
        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = aiohttp.ClientTimeout(total=max(timeout_s, 1e-3))
        try:
            async with self._session.request(method, self.base + path, params=params or None,
                                             json=json, **extra) as r:
                reply = HttpReply(r.status, r.reason or "", r.headers, await r.read())
                if self._log is not None and self._log.isEnabledFor(logging.DEBUG):
                    self._log.debug("HTTP Request: %s %s -> %d", method, self.secrets.mask_query(r.url),
                                    r.status)
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = classify(exc)
            assert kind is not None
            raise TransportError(kind, type(exc).__name__, self.secrets.redact(str(exc))) from None
        return reply


class KeyedApi:
    """Mixin: the lifecycle of an object that calls one HTTP API, with an optional API key.

    The class has ``config.api_key`` (a ``SecretStr`` or None), sets ``_client = None`` in its
    ``__init__`` and says how to open its client (:meth:`_open`); it gets an idempotent
    :meth:`start` (a :class:`ConfigError` when ``needs_key`` and there is no key), a :meth:`close`
    safe to call twice, the key as ``_key``, and :meth:`_clean` for the reasons it reports.
    """

    #: Whether :meth:`start` refuses to run without an API key.
    needs_key: ClassVar[bool] = False
    #: Longest reason line :meth:`_clean` gives.
    reason_chars: ClassVar[int] = 200
    config: Any
    _client: RetryingClient | None

    def _open(self, key: str | None) -> RetryingClient:
        """The client of this API (headers carrying ``key``); a bad setting is a ConfigError."""
        raise NotImplementedError

    def _missing_key(self) -> str:
        """The ConfigError's text when a required key is missing."""
        return f"{type(self).__name__} needs an api_key"

    @property
    def _key(self) -> str | None:
        return secret_value(self.config.api_key)

    async def start(self) -> None:
        """Open the HTTP client once; a missing required key is a config error."""
        if self._client is not None:
            return
        key = self._key
        if self.needs_key and key is None:
            raise ConfigError(self._missing_key())
        self._client = self._open(key)

    async def close(self) -> None:
        """Close the HTTP client (safe to call twice)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _clean(self, text: str) -> str:
        """One short line, with the API key blanked out wherever it appears."""
        return one_line(text, self.reason_chars, (self._key,))


# ---- the attempt loop -----------------------------------------------------------------------


class AttemptFailed(Exception):
    """Raised by one attempt of :func:`with_retries`.

    ``retry``: whether another attempt may help; ``wait_s``: how long the server asked us to wait
    (Retry-After), if it did; ``error``: what the loop raises when no attempt is left (this
    exception itself when None).
    """

    def __init__(self, reason: str, *, retry: bool = True, wait_s: float | None = None,
                 error: Exception | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry
        self.wait_s = wait_s
        self.error: Exception = error if error is not None else self


@dataclass(frozen=True)
class Backoff:
    """The wait before attempt ``n + 1``: the server's ``wait_s`` when it gave one (at most
    ``max_wait_s``), else ``base_s * 2 ** (n - 1)`` (at most ``max_s``); never negative."""

    base_s: float
    max_s: float
    max_wait_s: float = math.inf

    def delay(self, attempt: int, wait_s: float | None = None) -> float:
        """Seconds to wait after failed ``attempt`` (1-based)."""
        if wait_s is not None:
            return min(max(wait_s, 0.0), self.max_wait_s)
        return min(max(self.base_s * 2 ** (attempt - 1), 0.0), self.max_s)


async def with_retries(attempt: Callable[[int], Awaitable[T]], *, attempts: int, backoff: Backoff,
                       deadline: float | None = None,
                       on_failure: Callable[[int, AttemptFailed], None] | None = None,
                       on_retry: Callable[[int, AttemptFailed, float], None] | None = None,
                       ) -> tuple[T, int]:
    """``await attempt(n)`` for n = 1, 2, ... until one returns: its result and ``n``.

    An :class:`AttemptFailed` with ``retry`` is followed by a :class:`Backoff` wait and another
    attempt, up to ``attempts`` in all; without ``retry``, after the last attempt, or when the wait
    would reach ``deadline`` (a ``loop.time()``), its ``error`` is raised (nothing chained). With a
    ``deadline`` the whole loop runs under ``asyncio.timeout_at(deadline)``, so ``TimeoutError``
    comes out when an attempt is still running then. ``on_failure`` sees every failure,
    ``on_retry`` every retry with its delay. Other exceptions pass through at once.
    """
    loop = asyncio.get_running_loop()

    async def run() -> tuple[T, int]:
        for n in itertools.count(1):
            try:
                return await attempt(n), n
            except AttemptFailed as failed:
                if on_failure is not None:
                    on_failure(n, failed)
                delay = backoff.delay(n, failed.wait_s)
                if (not failed.retry or n >= attempts
                        or (deadline is not None and loop.time() + delay >= deadline)):
                    raise failed.error from None
                if on_retry is not None:
                    on_retry(n, failed, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    if deadline is None:
        return await run()
    async with asyncio.timeout_at(deadline):
        return await run()


# ---- small pure helpers ---------------------------------------------------------------------


def retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date); None if unusable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret (raw or URL-encoded) replaced by ``***``."""
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, quote(secret, safe=""), quote_plus(secret, safe="")}:
            text = text.replace(form, "***")
    return text


def one_line(text: str, max_chars: int, secrets: Iterable[str | None] = ()) -> str:
    """``text`` as one short line: white space folded, every secret blanked, then cut to
    ``max_chars`` (marked `` …``)."""
    line = redact(_SPACE.sub(" ", text).strip(), [s for s in secrets if s])
    return line if len(line) <= max_chars else line[:max_chars].rstrip() + " …"


def error_reason(reply: HttpReply, body: Any, from_body: Callable[[Any], str | None],
                 clean: Callable[[str], str]) -> str:
    """A short reason for a non-2xx reply: what ``from_body`` reads in its JSON ``body`` (None
    when not JSON), else its text with HTML tags blanked (proxies answer in HTML); "" if neither
    says anything. ``clean`` shortens and redacts."""
    reason = clean(from_body(body) or "") if body is not None else ""
    return reason or clean(_TAG.sub(" ", reply.text))


class SecretFilter(logging.Filter):
    """Blanks registered secrets out of a logger's lines; ``logger.addFilter`` it, ``add`` each key."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def add(self, secret: str | None) -> None:
        """Register ``secret`` (None and "" are ignored)."""
        if secret:
            self.secrets.add(secret)

    def redact(self, text: str) -> str:
        """``text`` with every registered secret blanked (:func:`redact`)."""
        return redact(text, self.secrets) if self.secrets else text

    def mask_query(self, url: URL) -> str:
        """The URL with the value of every query parameter that holds a registered secret masked."""
        secrets = self.secrets
        return str(url.with_query([(k, "***" if v in secrets else v) for k, v in url.query.items()]))

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            clean = self.redact(message)
            if clean != message:
                record.msg, record.args = clean, None
        return True
