"""Web-search providers against a real local HTTP server speaking each API's documented format."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from services.common.errors import (
    ConfigError,
    ProviderAuthError,
    ProviderBadResponse,
    ProviderError,
    ProviderHTTPError,
    ProviderRateLimited,
    ProviderTimeout,
)
from services.providers.base import ProviderAnswer, build_answer
from tests.support.http_fake import scripted_fixtures, started
from tests.unit.web_api_fakes import (
    APIS,
    ELASTIC,
    QUERY,
    ROBERTSON,
    WIKI,
    Api,
    FakeApis,
    Reply,
    brave_error,
    exa_ok,
    key_for,
    serpapi_error,
    serpapi_metadata,
    tavily_error,
    tavily_ok,
)

ALL = sorted(APIS)


server, fake = scripted_fixtures(FakeApis)


async def ask(api: Api, fake: FakeApis, *replies: Reply, **overrides: object) -> ProviderAnswer:
    """Script ``replies`` for ``api`` and run one search through a fresh provider."""
    fake.script(api.full_path(), *replies)
    async with started(api.make(fake, **overrides)) as provider:
        return await provider.search(QUERY)


async def fails(api: Api, fake: FakeApis, *replies: Reply, **overrides: object) -> ProviderError:
    """Like :func:`ask`, but the search must raise a ProviderError, which is returned."""
    with pytest.raises(ProviderError) as info:
        await ask(api, fake, *replies, **overrides)
    assert key_for(api.name) not in str(info.value)
    return info.value


# ---- normal answers, one per API -----------------------------------------------------------


async def test_searxng_answer_and_request(fake: FakeApis) -> None:
    answer = await ask(APIS["searxng"], fake, Reply(200, APIS["searxng"].ok()), k=2)

    assert [(c.rank, c.url, c.score) for c in answer.citations] == [(1, WIKI, 4.5), (2, ELASTIC, 1.25)]
    assert answer.citations[0].title == "Okapi BM25 - Wikipedia"
    assert answer.citations[0].snippet == "In information retrieval, Okapi BM25 is a ranking function."
    assert answer.answer == build_answer(answer.citations)
    assert answer.cost_usd == 0.01
    assert answer.raw_meta["unresponsive_engines"] == [["brave", "timeout"]]
    [req] = fake.received
    assert (req.method, req.path) == ("GET", "/searxng/search")
    assert req.params == {"q": QUERY, "format": "json"}
    assert req.headers["authorization"] == f"Bearer {key_for('searxng')}"
    assert req.headers["accept"] == "application/json"


async def test_searxng_without_key_sends_no_authorization(fake: FakeApis) -> None:
    answer = await ask(APIS["searxng"], fake, Reply(200, APIS["searxng"].ok()), api_key=None)

    assert [c.url for c in answer.citations] == [WIKI, ELASTIC, ROBERTSON]
    assert "authorization" not in fake.received[0].headers


async def test_brave_answer_and_request(fake: FakeApis) -> None:
    answer = await ask(APIS["brave"], fake, Reply(200, APIS["brave"].ok()), k=5)

    assert [(c.rank, c.url, c.score) for c in answer.citations] == [(1, WIKI, None), (2, ELASTIC, None)]
    assert answer.citations[0].title == "Okapi BM25 - Wikipedia"
    assert answer.citations[0].snippet == "In information retrieval, Okapi BM25 is a ranking function."
    assert answer.answer.startswith("[1] Okapi BM25 - Wikipedia: In information retrieval")
    assert answer.cost_usd == 0.01
    [req] = fake.received
    assert (req.method, req.path) == ("GET", "/brave/res/v1/web/search")
    assert req.params == {"q": QUERY, "count": "5"}
    assert req.headers["x-subscription-token"] == key_for("brave")
    assert req.headers["accept"] == "application/json"


async def test_brave_count_never_exceeds_its_maximum_of_20(fake: FakeApis) -> None:
    await ask(APIS["brave"], fake, Reply(200, APIS["brave"].ok()), k=50)

    assert fake.received[0].params["count"] == "20"


async def test_brave_without_web_section_is_an_empty_answer(fake: FakeApis) -> None:
    body = APIS["brave"].ok()
    del body["web"]
    answer = await ask(APIS["brave"], fake, Reply(200, body))

    assert answer.citations == () and answer.answer == ""


async def test_brave_invalid_token_422_is_an_auth_error(fake: FakeApis) -> None:
    error = await fails(APIS["brave"], fake, brave_error(
        422, "The provided subscription token is invalid.", code="SUBSCRIPTION_TOKEN_INVALID"))

    assert isinstance(error, ProviderAuthError) and error.status == 422
    assert "SUBSCRIPTION_TOKEN_INVALID: The provided subscription token is invalid." in error.message


async def test_tavily_answer_and_request(fake: FakeApis) -> None:
    answer = await ask(APIS["tavily"], fake, Reply(200, tavily_ok()), k=7)

    assert [(c.rank, c.url, c.score) for c in answer.citations] == [(1, WIKI, 0.91), (2, ELASTIC, 0.72)]
    assert answer.citations[1].snippet == "The BM25 algorithm and its variables."
    assert answer.answer == "BM25 is a bag-of-words ranking function."
    assert answer.cost_usd == 0.01
    [req] = fake.received
    assert (req.method, req.path) == ("POST", "/tavily/search")
    assert req.json == {"query": QUERY, "max_results": 7, "include_answer": True}
    assert req.headers["authorization"] == f"Bearer {key_for('tavily')}"


async def test_tavily_without_its_own_answer_builds_one(fake: FakeApis) -> None:
    answer = await ask(APIS["tavily"], fake, Reply(200, tavily_ok(answer=None)), k=1)

    assert len(answer.citations) == 1
    assert answer.answer == build_answer(answer.citations)


async def test_tavily_credit_limit_432_is_rate_limited_and_not_retried(fake: FakeApis) -> None:
    error = await fails(APIS["tavily"], fake, tavily_error(432, "Plan usage limit exceeded."),
                        max_retries=3)

    assert isinstance(error, ProviderRateLimited) and error.status == 432
    assert len(fake.received) == 1


async def test_exa_answer_request_and_reported_cost(fake: FakeApis) -> None:
    answer = await ask(APIS["exa"], fake, Reply(200, exa_ok(cost=0.006)), k=3)

    assert [(c.rank, c.url, c.score) for c in answer.citations] == [(1, WIKI, 0.38), (2, ROBERTSON, None)]
    assert answer.citations[0].snippet == "BM25 is a bag-of-words retrieval function. … It ranks documents."
    assert answer.citations[1].snippet == "The Probabilistic Relevance Framework: BM25 and Beyond."
    assert answer.cost_usd == 0.006
    assert answer.raw_meta["requestId"] == "b5947044c4b78efa9552a7c89b306d95"
    [req] = fake.received
    assert (req.method, req.path) == ("POST", "/exa/search")
    assert req.json == {"query": QUERY, "numResults": 3, "contents": {"highlights": True}}
    assert req.headers["x-api-key"] == key_for("exa")


async def test_exa_without_cost_charges_the_configured_cost(fake: FakeApis) -> None:
    answer = await ask(APIS["exa"], fake, Reply(200, exa_ok(cost=None)), cost_usd=0.02)

    assert answer.cost_usd == 0.02


async def test_serpapi_answer_and_request(fake: FakeApis) -> None:
    answer = await ask(APIS["serpapi"], fake, Reply(200, APIS["serpapi"].ok()), k=4)

    assert [(c.rank, c.url) for c in answer.citations] == [(1, WIKI), (2, ELASTIC)]
    assert answer.citations[1].title == "Practical BM25"
    assert answer.citations[1].snippet == "k1 and b explained."
    assert answer.cost_usd == 0.01
    [req] = fake.received
    assert (req.method, req.path) == ("GET", "/serpapi/search.json")
    assert req.params == {"engine": "google", "q": QUERY, "num": "4", "api_key": key_for("serpapi")}


async def test_serpapi_success_without_results_is_an_empty_answer(fake: FakeApis) -> None:
    body = {"search_metadata": serpapi_metadata("Success"),
            "search_information": {"organic_results_state": "Fully empty"},
            "error": "Google hasn't returned any results for this query."}
    answer = await ask(APIS["serpapi"], fake, Reply(200, body))

    assert answer.citations == () and answer.answer == ""


async def test_serpapi_failed_search_at_http_200_is_an_error(fake: FakeApis) -> None:
    body = {"search_metadata": serpapi_metadata("Error"),
            "error": "We couldn't get valid results for this search. Please try again later."}
    error = await fails(APIS["serpapi"], fake, Reply(200, body))

    assert type(error) is ProviderError
    assert "couldn't get valid results" in error.message


async def test_serpapi_error_body_at_http_200_without_metadata_is_an_error(fake: FakeApis) -> None:
    error = await fails(APIS["serpapi"], fake, serpapi_error(200, "Invalid API key."))

    assert type(error) is ProviderError and "Invalid API key." in error.message


async def test_serpapi_key_stays_out_of_request_logs(fake: FakeApis,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="services.providers.web"):
        await ask(APIS["serpapi"], fake, Reply(200, APIS["serpapi"].ok()))

    assert "HTTP Request: GET" in caplog.text and "api_key=***" in caplog.text
    assert key_for("serpapi") not in caplog.text and "S3CRET" not in caplog.text


# ---- errors, the same for every API --------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
async def test_401_is_an_auth_error_with_the_apis_reason(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    error = await fails(api, fake, api.error(401, "Invalid API key provided"), max_retries=2)

    assert isinstance(error, ProviderAuthError) and error.status == 401
    assert "Invalid API key provided" in error.message
    assert len(fake.received) == 1  # auth failures are not retried


@pytest.mark.parametrize("name", ALL)
async def test_429_is_retried_after_retry_after(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    limited = api.error(429, "Request rate limit exceeded")
    limited.headers["Retry-After"] = "0.2"
    t0 = time.perf_counter()
    answer = await ask(api, fake, limited, Reply(200, api.ok()), max_retries=1)

    assert time.perf_counter() - t0 >= 0.2
    assert len(fake.received) == 2 and answer.raw_meta["attempts"] == 2
    assert answer.citations[0].url == WIKI


async def test_retry_after_beyond_the_budget_fails_at_once(fake: FakeApis) -> None:
    api = APIS["exa"]
    limited = api.error(429, "Rate limit exceeded")
    limited.headers["Retry-After"] = "30"
    t0 = time.perf_counter()
    error = await fails(api, fake, limited, timeout_s=2.0, max_retries=3)

    assert isinstance(error, ProviderRateLimited) and error.status == 429
    assert "Rate limit exceeded" in error.message
    assert len(fake.received) == 1
    assert time.perf_counter() - t0 < 2.0  # not a speed figure: it gave up before its 2 s budget, not at its end


@pytest.mark.parametrize("name", ALL)
async def test_500_is_retried_then_an_http_error(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    error = await fails(api, fake, *[api.error(500, "Internal failure in upstream")] * 2,
                        max_retries=1)

    assert type(error) is ProviderHTTPError and error.status == 500
    assert "Internal failure in upstream" in error.message
    assert len(fake.received) == 2


async def test_backoff_stops_before_the_budget_with_the_real_error(fake: FakeApis) -> None:
    api = APIS["tavily"]
    error = await fails(api, fake, *[api.error(503, "overloaded")] * 6, timeout_s=0.35, max_retries=5)

    # the real error, not a timeout: the back-off stopped inside the budget, before its sixth attempt
    assert type(error) is ProviderHTTPError and error.status == 503
    assert 2 <= len(fake.received) < 6


@pytest.mark.parametrize("name", ALL)
async def test_4xx_error_body_gives_the_reason_and_is_not_retried(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    error = await fails(api, fake, api.error(400, "Missing query parameter"), max_retries=2)

    assert type(error) is ProviderHTTPError and error.status == 400
    assert "Missing query parameter" in error.message
    assert len(fake.received) == 1


@pytest.mark.parametrize("name", ALL)
async def test_garbage_200_is_a_bad_response(fake: FakeApis, name: str) -> None:
    garbage = Reply(200, raw=b"<html>\x00\xff not json", content_type="text/html")
    error = await fails(APIS[name], fake, garbage)

    assert isinstance(error, ProviderBadResponse) and "not JSON" in error.message


@pytest.mark.parametrize("name", ALL)
async def test_wrong_shape_json_is_a_bad_response(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    assert isinstance(await fails(api, fake, Reply(200, api.wrong_shape)), ProviderBadResponse)
    assert isinstance(await fails(api, fake, Reply(200, [api.ok()])), ProviderBadResponse)


@pytest.mark.parametrize("name", ALL)
async def test_slow_answer_is_a_timeout(fake: FakeApis, name: str) -> None:
    api = APIS[name]
    error = await fails(api, fake, Reply(200, api.ok(), delay_s=0.6), timeout_s=0.3)

    assert isinstance(error, ProviderTimeout)  # had it waited for the 0.6 s answer, it would have succeeded


async def test_connect_error_is_retried_then_a_provider_error(fake: FakeApis) -> None:
    with socket.socket() as sock:  # a port that is free, so nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = APIS["brave"].make(fake, base_url=f"http://127.0.0.1:{port}", max_retries=2)
    async with started(provider):
        with pytest.raises(ProviderError) as info:
            await provider.search(QUERY)

    assert type(info.value) is ProviderError and "cannot connect" in info.value.message
    assert info.value.__cause__ is None  # nothing from aiohttp (which knows the URL) is chained


async def test_cancellation_propagates(fake: FakeApis) -> None:
    api = APIS["exa"]
    fake.script(api.full_path(), Reply(200, api.ok(), delay_s=0.5))
    async with started(api.make(fake)) as provider:
        task = asyncio.create_task(provider.search(QUERY))
        assert await asyncio.to_thread(fake.arrived.wait, 5.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# ---- lifecycle -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["brave", "tavily", "exa", "serpapi"])
async def test_missing_key_is_a_config_error_at_start(fake: FakeApis, name: str) -> None:
    provider = APIS[name].make(fake, api_key=None)
    with pytest.raises(ConfigError):
        await provider.start()


async def test_one_client_per_provider_opened_in_start(fake: FakeApis) -> None:
    api = APIS["searxng"]
    fake.script(api.full_path(), Reply(200, api.ok()), Reply(200, api.ok()))
    provider = api.make(fake)
    with pytest.raises(ProviderError, match="not started"):
        await provider.search(QUERY)
    await provider.start()
    client = provider._client
    await provider.start()
    assert provider._client is client
    await provider.search(QUERY)
    await provider.search(QUERY)
    assert provider._client is client
    await provider.close()
    await provider.close()
    with pytest.raises(ProviderError, match="not started"):
        await provider.search(QUERY)
