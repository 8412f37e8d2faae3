"""Real web-search API providers over HTTP: SearXNG, Brave, Tavily, Exa and SerpAPI.

All five share :class:`_HttpProvider`: one ``aiohttp.ClientSession`` opened in ``start()``, one retry
loop held inside the ``timeout_s`` budget, and one mapping from HTTP failures to the typed
``ProviderError`` family. A subclass only says how to build its API's request and how to read its
API's answer and error bodies, as each vendor documents them.

aiohttp rather than httpx: on the gateway's hot path httpx cost ~3x the CPU per call (its pool
slows down badly with many requests in flight, and it re-parses URLs per request); measured
with bench/gateway_overhead.py.
"""

from __future__ import annotations

import abc
import asyncio
import email.utils
import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, Union
from urllib.parse import quote, quote_plus

import aiohttp
from multidict import CIMultiDictProxy
from pydantic import ValidationError
from yarl import URL

from schemas.trace import Citation
from services.common.errors import (
    ConfigError,
    ProviderAuthError,
    ProviderBadResponse,
    ProviderError,
    ProviderHTTPError,
    ProviderRateLimited,
    ProviderTimeout,
)
from services.common.settings import secret_value
from services.providers.base import Provider, ProviderAnswer, build_answer
from services.providers.config import (
    BraveConfig,
    ExaConfig,
    SearxngConfig,
    SerpApiConfig,
    TavilyConfig,
)

log = logging.getLogger(__name__)

WebConfig = Union[SearxngConfig, BraveConfig, TavilyConfig, ExaConfig, SerpApiConfig]

_BACKOFF_BASE_S = 0.1
_BACKOFF_MAX_S = 2.0
_REASON_CHARS = 200
_TITLE_CHARS = 4096
_SNIPPET_CHARS = 16384
_TAG = re.compile(r"<[^>]*>")
_SPACE = re.compile(r"\s+")


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
        return cls(url=_text(item.get(url)), title=_text(item.get(title)),
                   snippet=_text(item.get(snippet)), score=_number(item.get(score)) if score else None)


class _Retry(Exception):
    """Internal: this attempt failed in a way worth retrying (429, 5xx, connect error)."""

    def __init__(self, error: ProviderError, retry_after_s: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class _Reply:
    """One HTTP answer, read in full."""

    status: int
    reason: str
    headers: CIMultiDictProxy[str] | dict[str, str]
    content: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` when it is not."""
        return json.loads(self.content)


class _RedactSecrets(logging.Filter):
    """Blanks registered API keys out of log lines (SerpAPI carries its key in the URL)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            clean = _redact(message, self.secrets)
            if clean != message:
                record.msg, record.args = clean, None
        return True


_REDACTOR = _RedactSecrets()
log.addFilter(_REDACTOR)


class _HttpProvider(Provider):
    """Shared HTTP plumbing: one client per provider, a time-boxed retry loop and typed errors."""

    #: Whether the API refuses to work without ``api_key`` (checked in ``start``).
    needs_key: ClassVar[bool] = True
    #: Top-level response fields copied into ``ProviderAnswer.raw_meta`` when present.
    meta_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: WebConfig) -> None:
        super().__init__(config.name, cost_usd=config.cost_usd, timeout_s=config.timeout_s, k=config.k)
        self.config = config
        self._client: aiohttp.ClientSession | None = None
        self._base = ""

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

    def _error_class(self, status: int, body: Any) -> type[ProviderHTTPError]:
        """Which error an HTTP failure is: 401/403 auth, 429 rate limit, anything else plain HTTP."""
        if status in (401, 403):
            return ProviderAuthError
        if status == 429:
            return ProviderRateLimited
        return ProviderHTTPError

    def _own_answer(self, body: dict[str, Any]) -> str | None:
        """The answer text the API wrote itself, if it writes one."""
        return None

    def _own_cost(self, body: dict[str, Any]) -> float | None:
        """What the API says this call cost, if it says."""
        return None

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def _key(self) -> str | None:
        return secret_value(self.config.api_key)

    async def start(self) -> None:
        """Open the HTTP client once; a missing key or an unusable base URL is a config error."""
        if self._client is not None:
            return
        key = self._key
        if self.needs_key and key is None:
            raise ConfigError(f"provider {self.name!r} ({self.config.type}) needs an api_key")
        try:
            base = URL(self.config.base_url)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"provider {self.name!r}: bad base_url: {exc}") from None
        if base.scheme not in ("http", "https") or not base.host:
            raise ConfigError(f"provider {self.name!r}: base_url must be an http(s) URL")
        if key:
            _REDACTOR.secrets.add(key)
        headers = {"Accept": "application/json", **self._auth_headers(key)}
        self._base = str(base).rstrip("/")
        self._client = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=256, limit_per_host=256),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), raise_for_status=False)

    async def close(self) -> None:
        """Close the HTTP client (safe to call twice)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # ---- one query --------------------------------------------------------------------------

    async def search(self, query: str) -> ProviderAnswer:
        """Ask the API once (plus retries within ``timeout_s``) and rank up to ``k`` citations."""
        body, attempts = await self._fetch(self._request(query))
        citations = _rank(self._hits(body), self.k)
        answer = self._own_answer(body) or build_answer(citations)
        cost = self._own_cost(body)
        meta = {key: body[key] for key in self.meta_keys if key in body}
        return ProviderAnswer(citations=citations, answer=answer,
                              cost_usd=self.cost_usd if cost is None else cost,
                              raw_meta={"attempts": attempts, **meta})

    async def _fetch(self, request: ApiRequest) -> tuple[dict[str, Any], int]:
        """The JSON object of a 2xx answer and how many attempts it took, all within ``timeout_s``."""
        if self._client is None:
            raise ProviderError(self.name, "not started: call start() first")
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                return await self._with_retries(self._client, request, deadline)
        except ProviderError:
            raise
        except TimeoutError:
            raise ProviderTimeout(self.name, f"no answer within {self.timeout_s:g}s") from None

    async def _with_retries(self, client: aiohttp.ClientSession, request: ApiRequest,
                            deadline: float) -> tuple[dict[str, Any], int]:
        """Retry 429/5xx/connect failures with backoff (or Retry-After) while the budget allows."""
        loop = asyncio.get_running_loop()
        for attempt in itertools.count(1):
            try:
                return await self._attempt(client, request, deadline - loop.time()), attempt
            except _Retry as retry:
                delay = retry.retry_after_s
                if delay is None:
                    delay = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** (attempt - 1))
                if attempt > self.config.max_retries or loop.time() + delay >= deadline:
                    raise retry.error from None
                log.debug("%s: %s; retry %d in %.2fs", self.name, retry.error.message, attempt, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, client: aiohttp.ClientSession, request: ApiRequest,
                       budget_s: float) -> dict[str, Any]:
        """One HTTP exchange: the JSON object of a 2xx answer, else a typed error (or ``_Retry``)."""
        try:
            async with client.request(request.method, self._base + request.path,
                                      params=request.params or None, json=request.json,
                                      timeout=aiohttp.ClientTimeout(total=max(budget_s, 1e-3))) as r:
                response = _Reply(r.status, r.reason or "", r.headers, await r.read())
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("HTTP Request: %s %s -> %d", request.method, _masked(r.url), r.status)
        except TimeoutError as exc:  # aiohttp's ServerTimeoutError is one too
            raise ProviderTimeout(
                self.name, f"{type(exc).__name__} within the {self.timeout_s:g}s budget") from None
        except aiohttp.ClientConnectorError as exc:
            raise _Retry(ProviderError(self.name, f"cannot connect: {self._clean(str(exc))}")) from None
        except aiohttp.ClientError as exc:
            raise ProviderError(self.name, f"{type(exc).__name__}: {self._clean(str(exc))}") from None
        if response.ok:
            return self._decode(response)
        error = self._http_error(response)
        if response.status == 429 or response.status >= 500:
            raise _Retry(error, _retry_after_s(response.headers.get("retry-after")))
        raise error

    def _decode(self, response: _Reply) -> dict[str, Any]:
        """The body of a 2xx answer as a JSON object; anything else is a bad response."""
        try:
            body = response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content-type")
            raise ProviderBadResponse(
                self.name, f"HTTP {response.status} body is not JSON ({kind}, "
                           f"{len(response.content)} bytes)") from None
        if not isinstance(body, dict):
            raise ProviderBadResponse(self.name, f"expected a JSON object, got {type(body).__name__}")
        return body

    def _http_error(self, response: _Reply) -> ProviderHTTPError:
        """The typed error for a non-2xx answer, with a short reason from its body."""
        body = _json_or_none(response)
        reason = self._clean(self._error_reason(body) or "") if body is not None else ""
        reason = reason or self._clean(_TAG.sub(" ", response.text)) or response.reason
        status = response.status
        return self._error_class(status, body)(self.name, status, reason or "no reason given")

    def _clean(self, text: str) -> str:
        """One short line, with the API key blanked out wherever it appears."""
        line = _SPACE.sub(" ", text).strip()
        if len(line) > _REASON_CHARS:
            line = line[:_REASON_CHARS].rstrip() + " …"
        key = self._key
        return _redact(line, {key}) if key else line

    def _list(self, value: Any, where: str) -> list[dict[str, Any]]:
        """The result objects of a field that must be a JSON array (non-objects are skipped)."""
        if not isinstance(value, list):
            raise ProviderBadResponse(self.name, f"'{where}' is {type(value).__name__}, not a list")
        return [item for item in value if isinstance(item, dict)]


class SearxngProvider(_HttpProvider):
    """A SearXNG instance's JSON API: ``GET /search?q=…&format=json``.

    SearXNG has no API key of its own; when one is configured it goes to the reverse proxy in
    front of the instance as ``Authorization: Bearer``. The instance returns one page (about 10-20
    results, no count parameter), so we keep the first ``k``.
    """

    config: SearxngConfig
    needs_key = False
    meta_keys = ("number_of_results", "unresponsive_engines")

    def _auth_headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _request(self, query: str) -> ApiRequest:
        return ApiRequest("GET", "/search", params={"q": query, "format": "json"})

    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        return [Hit.of(item) for item in self._list(body.get("results"), "results")]


class BraveProvider(_HttpProvider):
    """Brave Search Web API: ``GET /res/v1/web/search?q=…&count=…`` with ``X-Subscription-Token``."""

    config: BraveConfig
    max_count: ClassVar[int] = 20  # Brave rejects count above 20

    def _auth_headers(self, key: str | None) -> dict[str, str]:
        return {"X-Subscription-Token": key or ""}

    def _request(self, query: str) -> ApiRequest:
        return ApiRequest("GET", "/res/v1/web/search",
                          params={"q": query, "count": min(self.k, self.max_count)})

    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        if body.get("type") != "search":
            raise ProviderBadResponse(self.name, f"response type is {body.get('type')!r}, not 'search'")
        web = body.get("web")
        if web is None:  # no web results for this query: Brave omits the section
            return []
        if not isinstance(web, dict):
            raise ProviderBadResponse(self.name, "'web' is not an object")
        hits = [Hit.of(item, snippet="description", score=None)
                for item in self._list(web.get("results"), "web.results")]
        # Brave marks query words with <strong> unless text_decorations=false; keep plain text.
        return [Hit(h.url, _untag(h.title), _untag(h.snippet)) for h in hits]

    def _error_reason(self, body: Any) -> str | None:
        error = _brave_error(body)
        if error is None:
            return None
        return ": ".join(_text(error.get(k)) for k in ("code", "detail") if _text(error.get(k)))

    def _error_class(self, status: int, body: Any) -> type[ProviderHTTPError]:
        error = _brave_error(body)
        if error is not None and error.get("code") == "SUBSCRIPTION_TOKEN_INVALID":
            return ProviderAuthError  # Brave reports a bad token as 422, not 401
        return super()._error_class(status, body)


class TavilyProvider(_HttpProvider):
    """Tavily: ``POST /search`` with ``Authorization: Bearer``; asks for Tavily's own short answer."""

    config: TavilyConfig
    max_results: ClassVar[int] = 20  # Tavily's documented range is 0-20
    meta_keys = ("request_id", "response_time")

    def _auth_headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def _request(self, query: str) -> ApiRequest:
        return ApiRequest("POST", "/search", json={
            "query": query, "max_results": min(self.k, self.max_results), "include_answer": True})

    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        return [Hit.of(item) for item in self._list(body.get("results"), "results")]

    def _own_answer(self, body: dict[str, Any]) -> str | None:
        return _text(body.get("answer")) or None

    def _error_reason(self, body: Any) -> str | None:
        detail = body.get("detail") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            return _text(detail.get("error")) or None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            return _text(detail[0].get("msg")) or None  # request validation errors
        return _text(detail) or None

    def _error_class(self, status: int, body: Any) -> type[ProviderHTTPError]:
        if status in (432, 433):  # plan / pay-as-you-go credit limit reached
            return ProviderRateLimited
        return super()._error_class(status, body)


class ExaProvider(_HttpProvider):
    """Exa: ``POST /search`` with ``x-api-key``, asking for highlights; reports its own cost."""

    config: ExaConfig
    max_results: ClassVar[int] = 100  # Exa's documented numResults range is 1-100
    meta_keys = ("requestId", "resolvedSearchType")

    def _auth_headers(self, key: str | None) -> dict[str, str]:
        return {"x-api-key": key or ""}

    def _request(self, query: str) -> ApiRequest:
        return ApiRequest("POST", "/search", json={
            "query": query, "numResults": min(self.k, self.max_results),
            "contents": {"highlights": True}})

    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        return [Hit(_text(item.get("url")), _text(item.get("title")), _exa_snippet(item),
                    _number(item.get("score")))
                for item in self._list(body.get("results"), "results")]

    def _own_cost(self, body: dict[str, Any]) -> float | None:
        cost = body.get("costDollars")
        total = _number(cost.get("total")) if isinstance(cost, dict) else None
        return total if total is not None and total >= 0 else None

    def _error_reason(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return None
        return ": ".join(_text(body.get(k)) for k in ("tag", "error") if _text(body.get(k))) or None


class SerpApiProvider(_HttpProvider):
    """SerpAPI: ``GET /search.json?engine=…&q=…&api_key=…&num=…``; reads ``organic_results``.

    SerpAPI reports a failed search as ``{"error": …}`` with ``search_metadata.status == "Error"``
    even on HTTP 200, but also sets ``error`` on a *successful* search that found nothing
    ("Google hasn't returned any results for this query."): that one is an empty answer.
    """

    config: SerpApiConfig
    meta_keys = ("search_metadata",)

    def _request(self, query: str) -> ApiRequest:
        return ApiRequest("GET", "/search.json", params={
            "engine": self.config.engine, "q": query, "num": self.k, "api_key": self._key or ""})

    def _hits(self, body: dict[str, Any]) -> list[Hit]:
        metadata = body.get("search_metadata")
        error = _text(body.get("error"))
        status = metadata.get("status") if isinstance(metadata, dict) else None
        if error and status != "Success":
            raise ProviderError(self.name, f"search failed: {self._clean(error)}")
        if not isinstance(metadata, dict):
            raise ProviderBadResponse(self.name, "'search_metadata' is missing")
        return [Hit.of(item, url="link", snippet="snippet", score=None)
                for item in self._list(body.get("organic_results", []), "organic_results")]

    def _error_reason(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return None
        return _text(body.get("error")) or None


# ---- small pure helpers ---------------------------------------------------------------------


def _rank(hits: list[Hit], k: int) -> tuple[Citation, ...]:
    """The first ``k`` usable hits as citations ranked 1..n; hits without a usable URL are skipped."""
    out: list[Citation] = []
    for hit in hits:
        if len(out) >= k:
            break
        if not hit.url:
            continue
        try:
            out.append(Citation(url=hit.url, title=hit.title[:_TITLE_CHARS], rank=len(out) + 1,
                                snippet=hit.snippet[:_SNIPPET_CHARS], score=hit.score))
        except ValidationError:  # e.g. a URL longer than the schema allows
            continue
    return tuple(out)


def _text(value: Any) -> str:
    """A JSON string field, stripped; anything else is empty."""
    return value.strip() if isinstance(value, str) else ""


def _number(value: Any) -> float | None:
    """A finite JSON number as float; anything else (including booleans) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _untag(text: str) -> str:
    """Text with HTML tags removed."""
    return _TAG.sub("", text)


def _exa_snippet(item: dict[str, Any]) -> str:
    """Exa's highlights joined, else its summary, else its page text."""
    highlights = item.get("highlights")
    if isinstance(highlights, list):
        joined = " … ".join(_text(h) for h in highlights if _text(h))
        if joined:
            return joined
    return _text(item.get("summary")) or _text(item.get("text"))


def _brave_error(body: Any) -> dict[str, Any] | None:
    """The error object of a Brave ``ErrorResponse`` (``error``, or the first of ``errors``)."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        return error
    errors = body.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        return errors[0]
    return None


def _json_or_none(response: _Reply) -> Any:
    """The body as JSON, or None when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return None


def _retry_after_s(value: str | None) -> float | None:
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


def _redact(text: str, secrets: set[str]) -> str:
    """``text`` with every secret (raw or URL-encoded) replaced by ``***``."""
    for secret in secrets:
        for form in {secret, quote(secret, safe=""), quote_plus(secret, safe="")}:
            text = text.replace(form, "***")
    return text


def _masked(url: URL) -> str:
    """The URL with the value of every query parameter that holds a registered key masked."""
    secrets = _REDACTOR.secrets
    return str(url.with_query([(k, "***" if v in secrets else v) for k, v in url.query.items()]))

