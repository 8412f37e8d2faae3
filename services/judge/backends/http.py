"""Shared plumbing of the judges that call an LLM over HTTP (OpenAI-compatible, Anthropic).

:class:`_HttpJudge` owns the HTTP client (one :class:`~services.common.retry_http.RetryingClient`,
opened in ``start()``) and drives its retry loop with a per-attempt timeout; a subclass only builds
its API's request and reads its API's reply and error bodies.

An attempt is retried, after a deterministic exponential backoff (or the server's Retry-After),
when a retry may help: 408/409/429/5xx (Anthropic's 529 included), a timeout, a broken
connection, a 2xx body we cannot read, or a reply whose text is not a valid judgement. Other
HTTP errors (bad request, bad key, unknown model) fail at once. The final ``JudgeFailed`` says
briefly what went wrong on each attempt; the API key is blanked out of every reason.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from yarl import URL

from services.common import retry_http
from services.common.errors import ConfigError
from services.common.retry_http import AttemptFailed, Failure, HttpReply, RetryingClient
from services.judge.base import (
    JudgeBackend,
    JudgeFailed,
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
)
from services.judge.parse import parse_judgement
from services.judge.settings_backends import AnthropicJudgeConfig, OpenAIJudgeConfig

log = logging.getLogger(__name__)

HttpJudgeConfig = Union[OpenAIJudgeConfig, AnthropicJudgeConfig]

#: Longest wait between attempts, whatever Retry-After or the backoff says.
MAX_WAIT_S = 60.0
#: Statuses worth another attempt; every 5xx is too.
RETRY_STATUSES = frozenset({408, 409, 429})


@dataclass(frozen=True)
class LlmReply:
    """The model's answer text and, when the API says it was cut short, how."""

    text: str
    truncated: str | None = None


class BadReply(Exception):
    """A 2xx body without a usable answer (subclasses raise it from ``_reply``)."""


class _HttpJudge(retry_http.KeyedApi, JudgeBackend):
    """A judge behind an HTTP API: one client, per-attempt timeout, retries, typed failures."""

    #: ``JudgeIdentity.kind``.
    kind: ClassVar[str]
    #: Path of the API call under the normalised base URL.
    path: ClassVar[str]
    reason_chars = 160

    def __init__(self, config: HttpJudgeConfig) -> None:
        self.config = config
        self.endpoint = normalise_endpoint(config.base_url)
        self.identity = JudgeIdentity(kind=self.kind, model=config.model, endpoint=self.endpoint)
        self._client: RetryingClient | None = None

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
        return retry_http.is_transient_status(status, RETRY_STATUSES)

    # ---- lifecycle --------------------------------------------------------------------------

    def _missing_key(self) -> str:
        return f"{self.kind} judge needs an api_key"

    def _open(self, key: str | None) -> RetryingClient:
        return RetryingClient(self.endpoint, timeout_s=self.config.timeout_s,
                              headers=self._headers(key))

    # ---- one judgement ----------------------------------------------------------------------

    async def judge(self, request: JudgeRequest) -> JudgeResult:
        """Ask the model, retrying what may pass next time; JudgeFailed says what failed each time."""
        client = self._client
        if client is None:
            raise JudgeFailed(f"{self.kind} judge is not started: call start() first")
        failures: list[str] = []

        def retrying(attempt: int, failed: AttemptFailed, delay: float) -> None:
            log.info("%s judge, trace %s: attempt %d failed (%s); retrying in %.2fs",
                     self.kind, request.trace_id, attempt, failed.reason, delay)

        try:
            result, _ = await retry_http.with_retries(
                lambda attempt: self._attempt(client, request, retry=attempt - 1),
                attempts=self.config.max_attempts, backoff=_backoff(self.config.backoff_s),
                on_failure=lambda attempt, failed: failures.append(f"{attempt}: {failed.reason}"),
                on_retry=retrying)
        except AttemptFailed:
            pass
        else:
            return result
        raise JudgeFailed(f"{self.kind} judge {self.config.model!r} failed after "
                          f"{len(failures)} attempt(s): " + "; ".join(failures))

    async def _attempt(self, client: RetryingClient, request: JudgeRequest,
                       retry: int) -> JudgeResult:
        """One HTTP exchange and the judgement in its reply; ``AttemptFailed`` otherwise."""
        reply = await self._post(client, self._body(request, retry))
        if not reply.ok:
            raise self._http_error(reply)
        answer = self._read(reply)
        try:
            return parse_judgement(answer.text, request.letters)
        except JudgeFailed as exc:
            cut = f" ({answer.truncated})" if answer.truncated else ""
            raise AttemptFailed(f"not a judgement: {self._clean(str(exc))}{cut}") from None

    async def _post(self, client: RetryingClient, body: dict[str, Any]) -> HttpReply:
        """POST ``body`` and read the whole answer, within ``timeout_s``; a timeout, a failed or
        broken connection is worth another attempt, any other client error is not."""
        try:
            return await client.send("POST", self.path, json=body)
        except retry_http.TransportError as exc:
            if exc.kind is Failure.TIMEOUT:
                raise AttemptFailed(f"no answer within {self.config.timeout_s:g}s") from None
            raise AttemptFailed(f"{exc.type_name}: {self._clean(exc.detail)}",
                                retry=exc.kind is not Failure.OTHER) from None

    def _http_error(self, reply: HttpReply) -> AttemptFailed:
        """The failure of a non-2xx answer: a short reason, whether to retry, the asked-for wait."""
        body = reply.json_or_none()
        reason = (retry_http.error_reason(reply, body, self._error_reason, self._clean)
                  or "no reason given")
        return AttemptFailed(f"HTTP {reply.status}: {reason}",
                             retry=self._retryable(reply.status, body),
                             wait_s=retry_after_s(reply.headers))

    def _read(self, reply: HttpReply) -> LlmReply:
        """The model's answer in a 2xx body; an unreadable body is worth another attempt."""
        body = reply.json_or_none()
        if not isinstance(body, dict):
            what = "not JSON" if body is None else f"a JSON {type(body).__name__}, not an object"
            kind = reply.headers.get("content-type", "no content-type")
            raise AttemptFailed(
                f"HTTP {reply.status} body is {what} ({kind}, {len(reply.content)} bytes)")
        try:
            return self._reply(body)
        except BadReply as exc:
            raise AttemptFailed(f"unusable reply: {self._clean(str(exc))}") from None


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


def _backoff(backoff_s: float) -> retry_http.Backoff:
    """``backoff_s`` doubled per attempt, or Retry-After if given, never over :data:`MAX_WAIT_S`."""
    return retry_http.Backoff(base_s=backoff_s, max_s=MAX_WAIT_S, max_wait_s=MAX_WAIT_S)


def backoff_delay(attempt: int, backoff_s: float, retry_after: float | None) -> float:
    """Seconds to wait after failed ``attempt`` (1-based): Retry-After if given, else doubling."""
    return _backoff(backoff_s).delay(attempt, retry_after)


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The server's requested wait: ``retry-after-ms`` (OpenAI's) first, then ``Retry-After``."""
    millis = retry_http.retry_after_s(headers.get("retry-after-ms"))
    return millis / 1000 if millis is not None else retry_http.retry_after_s(headers.get("retry-after"))


def text_field(value: Any) -> str:
    """A JSON string field, stripped; anything else is empty."""
    return value.strip() if isinstance(value, str) else ""
