"""What the web-search providers of :mod:`services.providers.web` share: :class:`HttpProvider`
over the common :class:`~services.common.retry_http.RetryingClient`, the request and result
records an API's subclass builds and reads, and the ranking of results into citations.

:class:`HttpProvider` holds one client opened in ``start()``, its retry loop inside the
``timeout_s`` budget (429/5xx and failed connects are retried, with backoff or as Retry-After
asks), and the mapping from HTTP failures to the typed ``ProviderError`` family.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from pydantic import TypeAdapter, ValidationError
from yarl import URL

from schemas.trace import Citation
from services.common import errors
from services.common.retry_http import (
    AttemptFailed,
    Backoff,
    Failure,
    HttpReply,
    KeyedApi,
    RetryingClient,
    SecretFilter,
    TransportError,
    error_reason,
    is_transient_status,
    retry_after_s,
    with_retries,
)
from services.providers.base import Provider, ProviderAnswer, build_answer
from services.providers.config import (
    BraveConfig,
    ExaConfig,
    SearxngConfig,
    SerpApiConfig,
    TavilyConfig,
)

#: The one logger of the web providers (request lines, retries), named after their module.
log = logging.getLogger("services.providers.web")
_SECRETS = SecretFilter()
log.addFilter(_SECRETS)  # SerpAPI carries its key in the URL

WebConfig = Union[SearxngConfig, BraveConfig, TavilyConfig, ExaConfig, SerpApiConfig]

_BACKOFF = Backoff(base_s=0.1, max_s=2.0)  # Retry-After is honoured as long as the budget allows
_TITLE_CHARS = 4096
_SNIPPET_CHARS = 16384
_TAG = re.compile(r"<[^>]*>")
_CITATIONS = TypeAdapter(tuple[Citation, ...])


@dataclass(frozen=True)
class ApiRequest:
    """One HTTP call to a search API: method, path under the base URL, query params, JSON body."""

    method: str
    path: str
    params: dict[str, str | int] = field(default_factory=dict)
    json: dict[str, Any] | None = None


@dataclass(frozen=True)
class Hit:
    """One result as the API gave it, before it becomes a ranked citation."""

    url: str
    title: str
    snippet: str
    score: float | None = None

    @classmethod
    def of(cls, item: dict[str, Any], *, url: str = "url", title: str = "title",
           snippet: str = "content", score: str | None = "score") -> Hit:
        """Read one result object whose fields have the given names."""
        return cls(url=text_field(item.get(url)), title=text_field(item.get(title)),
                   snippet=text_field(item.get(snippet)),
                   score=number_field(item.get(score)) if score else None)


class HttpProvider(KeyedApi, Provider):
    """A web-search API behind HTTP: one client per provider, a time-boxed retry loop, typed errors.

    A subclass says how to build its API's request (:meth:`_request`), where the results are in a
    2xx body (:meth:`_hits`), and, where the API documents them, the key's headers, its error
    bodies and statuses, its own answer text and its own cost.
    """

    needs_key = True  # every vendor but SearXNG refuses to work without a key
    #: Top-level response fields copied into ``ProviderAnswer.raw_meta`` when present.
    meta_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: WebConfig) -> None:
        super().__init__(config.name, cost_usd=config.cost_usd, timeout_s=config.timeout_s, k=config.k)
        self.config = config
        self._client: RetryingClient | None = None

    # ---- what a subclass says about its API -------------------------------------------------

    def _auth_headers(self, key: str | None) -> dict[str, str]:
        """Headers that carry the API key (none by default)."""
        return {}

    @abc.abstractmethod
    def _request(self, query: str) -> ApiRequest:
        """The HTTP request that asks this API for ``query``."""

    @abc.abstractmethod
    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        """The results of a 2xx JSON body, in the API's order; a wrong shape is a bad response."""

    def _error_reason(self, body: Any) -> str | None:
        """A short reason from the API's JSON error body, if it has its documented shape."""
        return None

    def _error_class(self, status: int, body: Any) -> type[errors.ProviderHTTPError]:
        """Which error an HTTP failure is: 401/403 auth, 429 rate limit, anything else plain HTTP."""
        if status in (401, 403):
            return errors.ProviderAuthError
        if status == 429:
            return errors.ProviderRateLimited
        return errors.ProviderHTTPError

    def _own_answer(self, body: dict[str, Any]) -> str | None:
        """The answer text the API wrote itself, if it writes one."""
        return None

    def _own_cost(self, body: dict[str, Any]) -> float | None:
        """What the API says this call cost, if it says."""
        return None

    # ---- lifecycle --------------------------------------------------------------------------

    def _missing_key(self) -> str:
        return f"provider {self.name!r} ({self.config.type}) needs an api_key"

    def _open(self, key: str | None) -> RetryingClient:
        """The client on ``base_url``, which must be an http(s) URL (else a config error)."""
        try:
            base = URL(self.config.base_url)
        except (ValueError, TypeError) as exc:
            raise errors.ConfigError(f"provider {self.name!r}: bad base_url: {exc}") from None
        if base.scheme not in ("http", "https") or not base.host:
            raise errors.ConfigError(f"provider {self.name!r}: base_url must be an http(s) URL")
        _SECRETS.add(key)
        return RetryingClient(str(base), timeout_s=self.timeout_s, headers=self._auth_headers(key),
                              connections=256, secrets=_SECRETS, log=log)

    # ---- one query --------------------------------------------------------------------------

    async def search(self, query: str) -> ProviderAnswer:
        """Ask the API once (plus retries within ``timeout_s``) and rank up to ``k`` citations."""
        body, attempts = await self._fetch(self._request(query))
        citations = rank(self._hits(body), self.k)
        answer = self._own_answer(body) or build_answer(citations)
        cost = self._own_cost(body)
        meta = {key: body[key] for key in self.meta_keys if key in body}
        return ProviderAnswer(citations=citations, answer=answer,
                              cost_usd=self.cost_usd if cost is None else cost,
                              raw_meta={"attempts": attempts, **meta})

    async def _fetch(self, request: ApiRequest) -> tuple[dict[str, Any], int]:
        """The JSON object of a 2xx answer and how many attempts it took, all within ``timeout_s``.

        429/5xx/connect failures are retried with backoff (or Retry-After) while the budget allows.
        """
        client = self._client
        if client is None:
            raise errors.ProviderError(self.name, "not started: call start() first")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            return await with_retries(
                lambda _: self._attempt(client, request, deadline - loop.time()),
                attempts=self.config.max_retries + 1, backoff=_BACKOFF, deadline=deadline,
                on_retry=self._log_retry)
        except errors.ProviderError:
            raise
        except TimeoutError:
            raise errors.ProviderTimeout(self.name, f"no answer within {self.timeout_s:g}s") from None

    def _log_retry(self, attempt: int, failed: AttemptFailed, delay: float) -> None:
        log.debug("%s: %s; retry %d in %.2fs", self.name, failed.reason, attempt, delay)

    async def _attempt(self, client: RetryingClient, request: ApiRequest,
                       budget_s: float) -> dict[str, Any]:
        """One HTTP exchange: the JSON object of a 2xx answer, else a typed error or AttemptFailed."""
        try:
            response = await client.send(request.method, request.path, params=request.params,
                                         json=request.json, timeout_s=budget_s)
        except TransportError as exc:
            raise self._transport_error(exc) from None
        if response.ok:
            return self._decode(response)
        error = self._http_error(response)
        if is_transient_status(response.status):
            raise AttemptFailed(error.message, error=error,
                                wait_s=retry_after_s(response.headers.get("retry-after")))
        raise error

    def _transport_error(self, exc: TransportError) -> Exception:
        """A timeout is final, a failed connect is worth another attempt, anything else is final."""
        if exc.kind is Failure.TIMEOUT:
            return errors.ProviderTimeout(
                self.name, f"{exc.type_name} within the {self.timeout_s:g}s budget")
        if exc.kind is Failure.CONNECT:
            error = errors.ProviderError(self.name, f"cannot connect: {self._clean(exc.detail)}")
            return AttemptFailed(error.message, error=error)
        return errors.ProviderError(self.name, f"{exc.type_name}: {self._clean(exc.detail)}")

    def _decode(self, response: HttpReply) -> dict[str, Any]:
        """The body of a 2xx answer as a JSON object; anything else is a bad response."""
        try:
            body = response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content-type")
            raise errors.ProviderBadResponse(
                self.name, f"HTTP {response.status} body is not JSON ({kind}, "
                           f"{len(response.content)} bytes)") from None
        if not isinstance(body, dict):
            raise errors.ProviderBadResponse(
                self.name, f"expected a JSON object, got {type(body).__name__}")
        return body

    def _http_error(self, response: HttpReply) -> errors.ProviderHTTPError:
        """The typed error for a non-2xx answer, with a short reason from its body."""
        body = response.json_or_none()
        reason = error_reason(response, body, self._error_reason, self._clean) or response.reason
        status = response.status
        return self._error_class(status, body)(self.name, status, reason or "no reason given")

    def _list(self, value: Any, where: str) -> list[dict[str, Any]]:
        """The result objects of a field that must be a JSON array (non-objects are skipped)."""
        if not isinstance(value, list):
            raise errors.ProviderBadResponse(
                self.name, f"'{where}' is {type(value).__name__}, not a list")
        return [item for item in value if isinstance(item, dict)]


# ---- small pure helpers ---------------------------------------------------------------------


def rank(hits: list[Hit], k: int) -> tuple[Citation, ...]:
    """The first ``k`` usable hits as citations ranked 1..n; hits without a usable URL are skipped."""
    rows = [{"url": h.url, "title": h.title[:_TITLE_CHARS], "snippet": h.snippet[:_SNIPPET_CHARS],
             "score": h.score} for h in hits if h.url]
    try:  # one validation call for the usual answer, where every hit is usable
        return _CITATIONS.validate_python([{**row, "rank": n} for n, row in enumerate(rows[:k], 1)])
    except ValidationError:  # e.g. a URL longer than the schema allows: skipped one by one
        pass
    out: list[Citation] = []
    for row in rows:
        if len(out) >= k:
            break
        try:
            out.append(Citation.model_validate({**row, "rank": len(out) + 1}))
        except ValidationError:
            continue
    return tuple(out)


def text_field(value: Any) -> str:
    """A JSON string field, stripped; anything else is empty."""
    return value.strip() if isinstance(value, str) else ""


def number_field(value: Any) -> float | None:
    """A finite JSON number as float; anything else (including booleans) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def untag(text: str) -> str:
    """Text with HTML tags removed."""
    return _TAG.sub("", text)
