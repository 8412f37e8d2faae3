"""Shared plumbing of the judges that call an LLM over HTTP (OpenAI-compatible, Anthropic).

:class:`_HttpJudge` owns the HTTP client (one ``aiohttp.ClientSession``, opened in ``start()``),
the per-attempt timeout and the retry loop; a subclass only builds its API's request and reads
its API's reply and error bodies.

An attempt is retried, after a deterministic exponential backoff (or the server's Retry-After),
when a retry may help: 408/409/429/5xx (Anthropic's 529 included), a timeout, a broken
connection, a 2xx body we cannot read, or a reply whose text is not a valid judgement. Other
HTTP errors (bad request, bad key, unknown model) fail at once. The final ``JudgeFailed`` says
briefly what went wrong on each attempt; the API key is blanked out of every reason.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import aiohttp
from yarl import URL

from services.common.errors import ConfigError
from services.common.settings import secret_value
from services.judge.base import (
    JudgeBackend,
    JudgeFailed,
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
)
from services.judge.parse import parse_judgement
from services.judge.settings_backends import AnthropicJudgeConfig, OpenAIJudgeConfig
from services.providers.web import _redact, _retry_after_s

log = logging.getLogger(__name__)

HttpJudgeConfig = Union[OpenAIJudgeConfig, AnthropicJudgeConfig]

#: Longest wait between attempts, whatever Retry-After or the backoff says.
MAX_WAIT_S = 60.0
#: Statuses worth another attempt; every 5xx is too.
RETRY_STATUSES = frozenset({408, 409, 429})
_REASON_CHARS = 160
_SPACE = re.compile(r"\s+")
_TAG = re.compile(r"<[^>]*>")


@dataclass(frozen=True)
class LlmReply:
    """The model's answer text and, when the API says it was cut short, how."""

    text: str
    truncated: str | None = None


class BadReply(Exception):
    """A 2xx body without a usable answer (subclasses raise it from ``_reply``)."""


class _AttemptFailed(Exception):
    """Internal: one attempt failed; whether another may help and how long the server asked to wait."""

    def __init__(self, reason: str, *, retry: bool, wait_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry
        self.wait_s = wait_s


class _HttpJudge(JudgeBackend):
    """A judge behind an HTTP API: one client, per-attempt timeout, retries, typed failures."""

    #: ``JudgeIdentity.kind``.
    kind: ClassVar[str]
    #: Path of the API call under the normalised base URL.
    path: ClassVar[str]
    #: Whether ``start()`` refuses to run without an API key.
    needs_key: ClassVar[bool] = False

    def __init__(self, config: HttpJudgeConfig) -> None:
        self.config = config
        self.endpoint = normalise_endpoint(config.base_url)
        self.identity = JudgeIdentity(kind=self.kind, model=config.model, endpoint=self.endpoint)
        self._client: aiohttp.ClientSession | None = None

    # ---- what a subclass says about its API -------------------------------------------------

    def _headers(self, key: str | None) -> dict[str, str]:
        """Headers sent on every call (the key's, the API version's)."""
        return {}

    @abc.abstractmethod
    def _body(self, request: JudgeRequest, retry: int) -> dict[str, Any]:
        """The JSON body asking for ``request``; ``retry`` is 0 on the first attempt."""

    @abc.abstractmethod
    def _reply(self, body: dict[str, Any]) -> LlmReply:
        """The answer text of a 2xx JSON body; :class:`BadReply` when it has none."""

    def _error_reason(self, body: Any) -> str | None:
        """A short reason from the API's JSON error body, if it has its documented shape."""
        return None

    def _retryable(self, status: int, body: Any) -> bool:
        """Whether an HTTP error status is worth another attempt."""
        return status in RETRY_STATUSES or status >= 500

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def _key(self) -> str | None:
        return secret_value(self.config.api_key)

    async def start(self) -> None:
        """Open the HTTP client once; a missing required key is a config error."""
        if self._client is not None:
            return
        key = self._key
        if self.needs_key and key is None:
            raise ConfigError(f"{self.kind} judge needs an api_key")
        self._client = aiohttp.ClientSession(
            headers={"Accept": "application/json", **self._headers(key)},
            timeout=aiohttp.ClientTimeout(total=self.config.timeout_s), raise_for_status=False)

    async def close(self) -> None:
        """Close the HTTP client (safe to call twice)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # ---- one judgement ----------------------------------------------------------------------

    async def judge(self, request: JudgeRequest) -> JudgeResult:
        """Ask the model, retrying what may pass next time; JudgeFailed says what failed each time."""
        client = self._client
        if client is None:
            raise JudgeFailed(f"{self.kind} judge is not started: call start() first")
        failures: list[str] = []
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                return await self._attempt(client, request, retry=attempt - 1)
            except _AttemptFailed as failed:
                failures.append(f"{attempt}: {failed.reason}")
                if not failed.retry or attempt == self.config.max_attempts:
                    break
                delay = backoff_delay(attempt, self.config.backoff_s, failed.wait_s)
                log.info("%s judge, trace %s: attempt %d failed (%s); retrying in %.2fs",
                         self.kind, request.trace_id, attempt, failed.reason, delay)
                await asyncio.sleep(delay)
        raise JudgeFailed(f"{self.kind} judge {self.config.model!r} failed after "
                          f"{len(failures)} attempt(s): " + "; ".join(failures))

    async def _attempt(self, client: aiohttp.ClientSession, request: JudgeRequest,
                       retry: int) -> JudgeResult:
        """One HTTP exchange and the judgement in its reply; ``_AttemptFailed`` otherwise."""
        status, headers, content = await self._post(client, self._body(request, retry))
        if not 200 <= status < 300:
            raise self._http_error(status, headers, content)
        reply = self._read(status, headers, content)
        try:
            return parse_judgement(reply.text, request.letters)
        except JudgeFailed as exc:
            cut = f" ({reply.truncated})" if reply.truncated else ""
            raise _AttemptFailed(f"not a judgement: {self._clean(str(exc))}{cut}", retry=True) from None

    async def _post(self, client: aiohttp.ClientSession,
                    body: dict[str, Any]) -> tuple[int, Mapping[str, str], bytes]:
        """POST ``body`` and read the whole answer, within ``timeout_s``."""
        try:
            async with client.post(self.endpoint + self.path, json=body) as response:
                return response.status, response.headers, await response.read()
        except TimeoutError:  # aiohttp's ServerTimeoutError and ConnectionTimeoutError are ones too
            raise _AttemptFailed(f"no answer within {self.config.timeout_s:g}s", retry=True) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _AttemptFailed(f"{type(exc).__name__}: {self._clean(str(exc))}", retry=True) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"{type(exc).__name__}: {self._clean(str(exc))}", retry=False) from None

    def _http_error(self, status: int, headers: Mapping[str, str], content: bytes) -> _AttemptFailed:
        """The failure of a non-2xx answer: a short reason, whether to retry, the asked-for wait."""
        body = _json_or_none(content)
        reason = self._clean(self._error_reason(body) or "") if body is not None else ""
        text = _TAG.sub(" ", content.decode("utf-8", errors="replace"))  # proxies answer in HTML
        reason = reason or self._clean(text) or "no reason given"
        return _AttemptFailed(f"HTTP {status}: {reason}", retry=self._retryable(status, body),
                              wait_s=retry_after_s(headers))

    def _read(self, status: int, headers: Mapping[str, str], content: bytes) -> LlmReply:
        """The model's answer in a 2xx body; an unreadable body is worth another attempt."""
        body = _json_or_none(content)
        if not isinstance(body, dict):
            what = "not JSON" if body is None else f"a JSON {type(body).__name__}, not an object"
            kind = headers.get("content-type", "no content-type")
            raise _AttemptFailed(f"HTTP {status} body is {what} ({kind}, {len(content)} bytes)",
                                 retry=True)
        try:
            return self._reply(body)
        except BadReply as exc:
            raise _AttemptFailed(f"unusable reply: {self._clean(str(exc))}", retry=True) from None

    def _clean(self, text: str) -> str:
        """One short line, with the API key blanked out wherever it appears."""
        line = _SPACE.sub(" ", text).strip()
        key = self._key
        line = _redact(line, {key}) if key else line
        return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS].rstrip() + " …"


# ---- small pure helpers ---------------------------------------------------------------------


def normalise_endpoint(base_url: str) -> str:
    """``scheme://host:port/path`` of a base URL, port explicit, no trailing slash; else ConfigError."""
    try:
        url = URL(base_url.strip())
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"bad judge base_url: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError("judge base_url must be an http(s) URL with a host")
    if url.user is not None or url.password is not None:
        raise ConfigError("judge base_url must not carry credentials: use api_key")
    if url.query_string or url.fragment:
        raise ConfigError("judge base_url must not have a query or fragment")
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{url.scheme}://{host}:{url.port}{url.raw_path.rstrip('/')}"


def backoff_delay(attempt: int, backoff_s: float, retry_after: float | None) -> float:
    """Seconds to wait after failed ``attempt`` (1-based): Retry-After if given, else doubling."""
    delay = retry_after if retry_after is not None else backoff_s * 2 ** (attempt - 1)
    return min(max(delay, 0.0), MAX_WAIT_S)


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The server's requested wait: ``retry-after-ms`` (OpenAI's) first, then ``Retry-After``."""
    millis = _retry_after_s(headers.get("retry-after-ms"))
    return millis / 1000 if millis is not None else _retry_after_s(headers.get("retry-after"))


def _json_or_none(content: bytes) -> Any:
    """The body as JSON, or None when it is not JSON."""
    try:
        return json.loads(content)
    except ValueError:
        return None


def text_field(value: Any) -> str:
    """A JSON string field, stripped; anything else is empty."""
    return value.strip() if isinstance(value, str) else ""
