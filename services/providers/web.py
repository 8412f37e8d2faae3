"""Real web-search API providers over HTTP: SearXNG, Brave, Tavily, Exa and SerpAPI.

Each is an :class:`~services.providers.web_base.HttpProvider` (one retrying client, typed
errors) that only says how to build its API's request and how to read its API's answer and error
bodies, as each vendor documents them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from services.common.errors import (
    ProviderAuthError,
    ProviderBadResponse,
    ProviderError,
    ProviderHTTPError,
    ProviderRateLimited,
)
from services.providers.config import BraveConfig, ExaConfig, SearxngConfig, SerpApiConfig, TavilyConfig
from services.providers.web_base import (
    ApiRequest,
    Hit,
    HttpProvider,
    WebConfig,
    number_field,
    text_field,
    untag,
)

__all__ = ["BraveProvider", "ExaProvider", "SearxngProvider", "SerpApiProvider", "TavilyProvider",
           "WebConfig"]


class SearxngProvider(HttpProvider):
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


class BraveProvider(HttpProvider):
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
        return [Hit(h.url, untag(h.title), untag(h.snippet)) for h in hits]

    def _error_reason(self, body: Any) -> str | None:
        error = _brave_error(body)
        if error is None:
            return None
        parts = (text_field(error.get(k)) for k in ("code", "detail"))
        return ": ".join(part for part in parts if part)

    def _error_class(self, status: int, body: Any) -> type[ProviderHTTPError]:
        error = _brave_error(body)
        if error is not None and error.get("code") == "SUBSCRIPTION_TOKEN_INVALID":
            return ProviderAuthError  # Brave reports a bad token as 422, not 401
        return super()._error_class(status, body)


class TavilyProvider(HttpProvider):
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
        return text_field(body.get("answer")) or None

    def _error_reason(self, body: Any) -> str | None:
        detail = body.get("detail") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            return text_field(detail.get("error")) or None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            return text_field(detail[0].get("msg")) or None  # request validation errors
        return text_field(detail) or None

    def _error_class(self, status: int, body: Any) -> type[ProviderHTTPError]:
        if status in (432, 433):  # plan / pay-as-you-go credit limit reached
            return ProviderRateLimited
        return super()._error_class(status, body)


class ExaProvider(HttpProvider):
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
        return [Hit(text_field(item.get("url")), text_field(item.get("title")), _exa_snippet(item),
                    number_field(item.get("score")))
                for item in self._list(body.get("results"), "results")]

    def _own_cost(self, body: dict[str, Any]) -> float | None:
        cost = body.get("costDollars")
        total = number_field(cost.get("total")) if isinstance(cost, dict) else None
        return total if total is not None and total >= 0 else None

    def _error_reason(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return None
        parts = (text_field(body.get(k)) for k in ("tag", "error"))
        return ": ".join(part for part in parts if part) or None


class SerpApiProvider(HttpProvider):
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
        error = text_field(body.get("error"))
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
        return text_field(body.get("error")) or None


# ---- vendor-specific helpers ---------------------------------------------------------------


def _exa_snippet(item: dict[str, Any]) -> str:
    """Exa's highlights joined, else its summary, else its page text."""
    highlights = item.get("highlights")
    if isinstance(highlights, list):
        joined = " … ".join(text_field(h) for h in highlights if text_field(h))
        if joined:
            return joined
    return text_field(item.get("summary")) or text_field(item.get("text"))


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
