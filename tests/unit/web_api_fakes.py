"""Local fakes of the web-search APIs: a real HTTP server on 127.0.0.1 answering in each vendor's
documented request/response format, with replies scripted per test and every request recorded.

Each API lives under its own path prefix (``/searxng``, ``/brave``, ...) on one server, so a
provider's ``base_url`` is ``http://127.0.0.1:<port>/<api>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from services.providers import config as c
from services.providers import web, web_base
from tests.support.http_fake import Reply, ScriptedServer

__all__ = ["FakeApis", "Reply"]

QUERY = "what is okapi bm25"


class FakeApis(ScriptedServer):
    """The scripted loopback server; each API under its own prefix (``/searxng``, ``/brave``, ...)."""

    def __init__(self) -> None:
        super().__init__("fake-web-apis")

    def base_url(self, api: str) -> str:
        return self.url(api)


# ---- each API's documented formats ---------------------------------------------------------

WIKI = "https://en.wikipedia.org/wiki/Okapi_BM25"
ELASTIC = "https://www.elastic.co/blog/practical-bm25-part-2-the-bm25-algorithm-and-its-variables"
ROBERTSON = "https://www.staff.city.ac.uk/~sbrp622/papers/foundations_bm25_review.pdf"


def searxng_ok() -> dict[str, Any]:
    """``GET /search?format=json``: results with url/title/content/engine(s)/score."""
    return {
        "query": QUERY,
        "number_of_results": 0,
        "results": [
            {"url": WIKI, "title": "Okapi BM25 - Wikipedia", "engine": "wikipedia",
             "content": "In information retrieval, Okapi BM25 is a ranking function.",
             "parsed_url": ["https", "en.wikipedia.org", "/wiki/Okapi_BM25", "", "", ""],
             "template": "default.html", "engines": ["wikipedia", "duckduckgo"], "positions": [1, 3],
             "score": 4.5, "category": "general", "publishedDate": None},
            {"title": "BM25 (infobox without a link)", "content": "no url here", "engine": "wikidata",
             "engines": ["wikidata"], "positions": [1], "score": 3.0, "category": "general"},
            {"url": ELASTIC, "title": "Practical BM25 - Part 2", "engine": "duckduckgo",
             "content": "How BM25 scores a document: k1 and b.", "engines": ["duckduckgo"],
             "positions": [2], "score": 1.25, "category": "general"},
            {"url": ROBERTSON, "title": "The Probabilistic Relevance Framework", "engine": "google",
             "content": "Robertson and Zaragoza.", "engines": ["google"], "positions": [4],
             "score": 0.5, "category": "general"},
        ],
        "answers": [], "corrections": [], "infoboxes": [], "suggestions": ["bm25 formula"],
        "unresponsive_engines": [["brave", "timeout"]],
    }


def searxng_error(status: int, message: str) -> Reply:
    """SearXNG (Flask/werkzeug) errors are HTML pages, not JSON."""
    html = (f"<!doctype html>\n<html lang=en>\n<title>{status} Error</title>\n<h1>Error</h1>\n"
            f"<p>{message}</p>\n")
    return Reply(status, raw=html.encode(), content_type="text/html; charset=utf-8")


def brave_ok() -> dict[str, Any]:
    """``GET /res/v1/web/search``: ``{"type": "search", "web": {"results": [...]}}``, <strong> marks."""
    def result(url: str, title: str, description: str) -> dict[str, Any]:
        return {"type": "search_result", "subtype": "generic", "is_live": False, "title": title,
                "url": url, "description": description, "is_source_local": False,
                "is_source_both": False, "language": "en", "family_friendly": True,
                "profile": {"name": "Wikipedia", "url": url, "long_name": "en.wikipedia.org",
                            "img": "https://imgs.search.brave.com/x.png"},
                "meta_url": {"scheme": "https", "netloc": "en.wikipedia.org",
                             "hostname": "en.wikipedia.org", "favicon": "", "path": "› wiki"}}
    return {
        "type": "search",
        "query": {"original": QUERY, "show_strict_warning": False, "is_navigational": False,
                  "is_news_breaking": False, "spellcheck_off": True, "country": "us",
                  "bad_results": False, "should_fallback": False, "postal_code": "", "city": "",
                  "header_country": "", "more_results_available": True, "state": ""},
        "mixed": {"type": "mixed", "main": [{"type": "web", "index": 0, "all": False}],
                  "top": [], "side": []},
        "web": {"type": "search", "family_friendly": True, "results": [
            result(WIKI, "Okapi <strong>BM25</strong> - Wikipedia",
                   "In information retrieval, Okapi <strong>BM25</strong> is a ranking function."),
            result(ELASTIC, "Practical <strong>BM25</strong>", "k1 and b in <strong>BM25</strong>."),
        ]},
    }


def brave_error(status: int, message: str, code: str = "GENERIC_ERROR") -> Reply:
    """Brave's ``ErrorResponse``: ``{"type": "ErrorResponse", "error": {"code", "detail", ...}}``."""
    return Reply(status, {"type": "ErrorResponse", "time": 1663072993, "error": {
        "id": "5d832250-9396-4f6e-b84a-2a1fe524cd7d", "status": status, "code": code,
        "detail": message, "meta": {"component": "api"}}})


def tavily_ok(answer: str | None = "BM25 is a bag-of-words ranking function.") -> dict[str, Any]:
    """``POST /search``: ``{"query", "answer", "results": [{title,url,content,score}], ...}``."""
    return {
        "query": QUERY, "follow_up_questions": None, "answer": answer, "images": [],
        "results": [
            {"title": "Okapi BM25 - Wikipedia", "url": WIKI, "score": 0.91, "raw_content": None,
             "content": "Okapi BM25 is a ranking function used by search engines."},
            {"title": "Practical BM25", "url": ELASTIC, "score": 0.72, "raw_content": None,
             "content": "The BM25 algorithm and its variables."},
        ],
        "response_time": 1.09, "request_id": "123e4567-e89b-12d3-a456-426614174111",
    }


def tavily_error(status: int, message: str) -> Reply:
    """Tavily errors: ``{"detail": {"error": "..."}}``."""
    return Reply(status, {"detail": {"error": message}})


def exa_ok(cost: float | None = 0.006) -> dict[str, Any]:
    """``POST /search``: ``{"requestId", "results": [...], "costDollars": {"total", ...}}``."""
    body: dict[str, Any] = {
        "requestId": "b5947044c4b78efa9552a7c89b306d95", "resolvedSearchType": "neural",
        "results": [
            {"id": WIKI, "url": WIKI, "title": "Okapi BM25", "score": 0.38,
             "publishedDate": "2023-11-16T01:36:32.547Z", "author": "Wikipedia contributors",
             "highlights": ["BM25 is a bag-of-words retrieval function.", "It ranks documents."],
             "highlightScores": [0.41, 0.33]},
            {"id": ROBERTSON, "url": ROBERTSON, "title": "The Probabilistic Relevance Framework",
             "publishedDate": None, "author": None, "highlights": [],
             "text": "The Probabilistic Relevance Framework: BM25 and Beyond."},
        ],
    }
    if cost is not None:
        body["costDollars"] = {"total": cost, "search": {"neural": 0.005},
                               "contents": {"highlights": 0.001}}
    return body


def exa_error(status: int, message: str, tag: str = "INTERNAL_ERROR") -> Reply:
    """Exa errors: ``{"requestId", "error", "tag"}``."""
    return Reply(status, {"requestId": "0f3b0b1c2d", "error": message, "tag": tag})


def serpapi_metadata(status: str = "Success") -> dict[str, Any]:
    return {"id": "64c32cfeb68f8bc186aaa013", "status": status,
            "json_endpoint": "https://serpapi.com/searches/d46c933a4a843289/64c32cfeb68f8bc186aaa013.json",
            "created_at": "2026-07-28 07:49:18 UTC", "processed_at": "2026-07-28 07:49:18 UTC",
            "google_url": "https://www.google.com/search?q=what+is+okapi+bm25&oq=what+is+okapi+bm25",
            "total_time_taken": 1.31}


def serpapi_ok() -> dict[str, Any]:
    """``GET /search.json``: ``search_metadata`` + ``organic_results[{position,title,link,snippet}]``."""
    return {
        "search_metadata": serpapi_metadata(),
        "search_parameters": {"engine": "google", "q": QUERY, "google_domain": "google.com",
                              "device": "desktop"},
        "search_information": {"query_displayed": QUERY, "total_results": 312000,
                               "time_taken_displayed": 0.31,
                               "organic_results_state": "Results for exact spelling"},
        "organic_results": [
            {"position": 1, "title": "Okapi BM25 - Wikipedia", "link": WIKI,
             "redirect_link": "https://www.google.com/url?url=" + WIKI,
             "displayed_link": "https://en.wikipedia.org › wiki › Okapi_BM25",
             "snippet": "In information retrieval, Okapi BM25 is a ranking function.",
             "snippet_highlighted_words": ["Okapi BM25"], "source": "Wikipedia"},
            {"position": 2, "title": "Practical BM25", "link": ELASTIC,
             "displayed_link": "https://www.elastic.co › blog", "snippet": "k1 and b explained.",
             "source": "Elastic"},
        ],
    }


def serpapi_error(status: int, message: str) -> Reply:
    """SerpAPI errors: ``{"error": "..."}``."""
    return Reply(status, {"error": message})


@dataclass(frozen=True)
class Api:
    """What the generic tests need to know about one fake API."""

    name: str
    path: str
    provider: Callable[..., web_base.HttpProvider]
    config: Callable[..., c.SearxngConfig | c.BraveConfig | c.TavilyConfig | c.ExaConfig
                     | c.SerpApiConfig]
    ok: Callable[[], dict[str, Any]]
    error: Callable[[int, str], Reply]
    wrong_shape: dict[str, Any]

    def make(self, fake: FakeApis, **overrides: Any) -> web_base.HttpProvider:
        """A provider of this API pointed at the fake server."""
        settings: dict[str, Any] = {"name": f"{self.name}-test", "base_url": fake.base_url(self.name),
                                    "api_key": key_for(self.name), "timeout_s": 3.0, "k": 5,
                                    "cost_usd": 0.01, "max_retries": 1}
        settings.update(overrides)
        return self.provider(self.config(**settings))

    def full_path(self) -> str:
        return f"/{self.name}{self.path}"


def key_for(api: str) -> str:
    return f"sk-{api}-S3CRET+key/=="


APIS = {
    "searxng": Api("searxng", "/search", web.SearxngProvider, c.SearxngConfig, searxng_ok,
                   searxng_error, {"query": QUERY, "results": {"url": WIKI}}),
    "brave": Api("brave", "/res/v1/web/search", web.BraveProvider, c.BraveConfig, brave_ok,
                 brave_error, {"type": "search", "web": {"type": "search", "results": "none"}}),
    "tavily": Api("tavily", "/search", web.TavilyProvider, c.TavilyConfig, tavily_ok,
                  tavily_error, {"query": QUERY, "answer": None, "results": None}),
    "exa": Api("exa", "/search", web.ExaProvider, c.ExaConfig, exa_ok, exa_error,
               {"requestId": "r1", "data": {"results": []}}),
    "serpapi": Api("serpapi", "/search.json", web.SerpApiProvider, c.SerpApiConfig, serpapi_ok,
                   serpapi_error, {"search_metadata": serpapi_metadata(),
                                   "organic_results": {"position": 1, "link": WIKI}}),
}
