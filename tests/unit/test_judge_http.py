"""HTTP judge backends against a real local server speaking OpenAI's and Anthropic's wire formats.

The fake (uvicorn + starlette on 127.0.0.1, in a background thread) serves both APIs under their
own path prefixes, answers with replies scripted per test, and records every request it gets.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.judge.backends.anthropic import AnthropicJudge
from services.judge.backends.http import (
    _HttpJudge,
    backoff_delay,
    normalise_endpoint,
    retry_after_s,
)
from services.judge.backends.openai import OpenAIJudge, seed_for
from services.judge.base import BlindCandidate, JudgeFailed, JudgeRequest, Source
from services.judge.rubric import SYSTEM, render_user
from services.judge.settings_backends import AnthropicJudgeConfig, OpenAIJudgeConfig
from tests.support.http_fake import Reply, ScriptedServer, scripted_fixtures, started

KEY = "sk-judge-S3CRET+key/=="
GOOD = '{"grades": {"A": 3, "B": 1, "C": 0}, "ranking": [["A"], ["B"], ["C"]]}'
BAD = '{"grades": {"A": 7, "B": 1, "C": 0}, "ranking": [["A"], ["B"], ["C"]]}'
#: Names that would tell the judge who answered: provider types and the default provider names.
PROVIDER_NAMES = re.compile(r"bm25|dense|synthetic|searxng|brave|tavily|\bexa\b|serp|minilm|bio-|lib-|eng-",
                            re.IGNORECASE)


def request(trace_id: str = "trace-1", attempt: int = 0) -> JudgeRequest:
    """Three blind candidates with innocuous text about tides."""
    return JudgeRequest(trace_id=trace_id, attempt=attempt, query="why does the sea have tides", candidates=(
        BlindCandidate("A", "The moon's gravity pulls the oceans, raising two bulges.",
                       (Source("Tides explained", "Gravity of the moon and sun raises the sea."),)),
        BlindCandidate("B", "Wind moves water around.", (Source("Weather", "Wind and waves."),)),
        BlindCandidate("C", "", ()),
    ))


# ---- the fake server -----------------------------------------------------------------------


class FakeLlmApis(ScriptedServer):
    """The scripted loopback server, OpenAI under ``/openai``, Anthropic under ``/anthropic``."""

    def __init__(self) -> None:
        super().__init__("fake-llm-apis")


# ---- each API's documented formats ---------------------------------------------------------


def openai_ok(content: str | None, finish_reason: str = "stop", refusal: str | None = None) -> Reply:
    """A chat completion: ``choices[0].message.content``."""
    return Reply(200, {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG", "object": "chat.completion",
        "created": 1741570283, "model": "judge-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": refusal,
                                             "annotations": []},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 410, "completion_tokens": 31, "total_tokens": 441},
        "system_fingerprint": "fp_06737a9306"})


def openai_error(status: int, message: str, kind: str, code: str | None = None, **headers: str) -> Reply:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return Reply(status, {"error": {"message": message, "type": kind, "param": None, "code": code}},
                 headers=headers)


def vllm_flat_error(status: int, message: str) -> Reply:
    """Older vLLM servers: the error fields at the top level with ``"object": "error"``."""
    return Reply(status, {"object": "error", "message": message, "type": "BadRequestError",
                          "param": None, "code": status})


def anthropic_ok(*texts: str, stop_reason: str = "end_turn") -> Reply:
    """A message: ``content`` blocks, of which the ``text`` ones carry the answer."""
    return Reply(200, {
        "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant",
        "model": "judge-model", "content": [{"type": "text", "text": t} for t in texts],
        "stop_reason": stop_reason, "stop_sequence": None,
        "usage": {"input_tokens": 410, "output_tokens": 31}})


def anthropic_error(status: int, kind: str, message: str, **headers: str) -> Reply:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return Reply(status, {"type": "error", "error": {"type": kind, "message": message},
                          "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"}, headers=headers)


@dataclass(frozen=True)
class Api:
    """What the generic tests need to know about one API."""

    name: str
    path: str
    make: Callable[..., _HttpJudge]
    ok: Callable[[str], Reply]
    error: Callable[..., Reply]


def make_openai(fake: FakeLlmApis, **overrides: Any) -> OpenAIJudge:
    settings: dict[str, Any] = {"base_url": fake.url("openai/v1"), "model": "judge-model",
                                "api_key": KEY, "timeout_s": 3.0, "max_attempts": 3, "backoff_s": 0.01,
                                "max_tokens": 300}
    return OpenAIJudge(OpenAIJudgeConfig(**{**settings, **overrides}))


def make_anthropic(fake: FakeLlmApis, **overrides: Any) -> AnthropicJudge:
    settings: dict[str, Any] = {"base_url": fake.url("anthropic"), "model": "judge-model",
                                "api_key": KEY, "timeout_s": 3.0, "max_attempts": 3, "backoff_s": 0.01,
                                "max_tokens": 300}
    return AnthropicJudge(AnthropicJudgeConfig(**{**settings, **overrides}))


APIS = {
    "openai": Api("openai", "/openai/v1/chat/completions", make_openai, openai_ok,
                  lambda status, message, **h: openai_error(status, message, "server_error", **h)),
    "anthropic": Api("anthropic", "/anthropic/v1/messages", make_anthropic, anthropic_ok,
                     lambda status, message, **h: anthropic_error(status, "api_error", message, **h)),
}
BOTH = sorted(APIS)


# ---- fixtures and helpers ------------------------------------------------------------------


server, fake = scripted_fixtures(FakeLlmApis)


async def run(api: Api, fake: FakeLlmApis, *replies: Reply, **overrides: Any):
    """Script ``replies`` for ``api`` and judge :func:`request` once through a fresh backend."""
    fake.script(api.path, *replies)
    async with started(api.make(fake, **overrides)) as judge:
        return await judge.judge(request())


async def fails(api: Api, fake: FakeLlmApis, *replies: Reply, **overrides: Any) -> str:
    """Like :func:`run`, but the judgement must fail; returns the JudgeFailed message."""
    with pytest.raises(JudgeFailed) as info:
        await run(api, fake, *replies, **overrides)
    return str(info.value)


# ---- the good path and what goes on the wire ------------------------------------------------


@pytest.mark.parametrize("name", BOTH)
async def test_good_answer(fake: FakeLlmApis, name: str) -> None:
    result = await run(APIS[name], fake, APIS[name].ok(GOOD))
    assert result.grades == {"A": 3, "B": 1, "C": 0}
    assert result.ordering == (("A",), ("B",), ("C",))
    assert result.raw == GOOD
    assert len(fake.received) == 1


@pytest.mark.parametrize("name", BOTH)
async def test_answer_in_code_fence_and_prose(fake: FakeLlmApis, name: str) -> None:
    text = f"Here is my assessment.\n\n```json\n{GOOD}\n```\n\nA is clearly the best answer."
    result = await run(APIS[name], fake, APIS[name].ok(text))
    assert result.grades["A"] == 3 and result.raw == text


async def test_openai_request_on_the_wire(fake: FakeLlmApis) -> None:
    await run(APIS["openai"], fake, openai_ok(GOOD))
    [seen] = fake.received
    assert seen.path == "/openai/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.headers["content-type"].startswith("application/json")
    body = seen.json
    assert body == {"model": "judge-model",
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": render_user(request())}],
                    "temperature": 0, "max_tokens": 300, "seed": seed_for("trace-1", 0, 0)}
    assert not PROVIDER_NAMES.search(seen.raw.decode())


async def test_anthropic_request_on_the_wire(fake: FakeLlmApis) -> None:
    await run(APIS["anthropic"], fake, anthropic_ok(GOOD))
    [seen] = fake.received
    assert seen.path == "/anthropic/v1/messages"
    assert seen.headers["x-api-key"] == KEY
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.headers["content-type"].startswith("application/json")
    assert "authorization" not in seen.headers
    assert seen.json == {"model": "judge-model", "max_tokens": 300, "system": SYSTEM,
                         "messages": [{"role": "user", "content": render_user(request())}],
                         "temperature": 0}
    assert not PROVIDER_NAMES.search(seen.raw.decode())


async def test_openai_without_key_sends_no_authorization(fake: FakeLlmApis) -> None:
    await run(APIS["openai"], fake, openai_ok(GOOD), api_key=None)
    assert "authorization" not in fake.received[0].headers


async def test_anthropic_joins_text_blocks_and_skips_others(fake: FakeLlmApis) -> None:
    reply = anthropic_ok('{"grades": {"A": 3, "B": 1, "C": 0}, ', '"ranking": [["A"], ["B"], ["C"]]}')
    reply.body["content"].insert(0, {"type": "thinking", "thinking": '{"grades": {"A": 0}}',
                                     "signature": "sig"})
    result = await run(APIS["anthropic"], fake, reply)
    assert result.grades == {"A": 3, "B": 1, "C": 0}


def test_identity_and_endpoint() -> None:
    judge = OpenAIJudge(OpenAIJudgeConfig(base_url="HTTP://Judge.Local:8000/v1/", model="m"))
    assert (judge.identity.kind, judge.identity.model) == ("openai", "m")
    assert judge.identity.endpoint == "http://judge.local:8000/v1"
    default = AnthropicJudge(AnthropicJudgeConfig(model="claude-x"))
    assert default.identity.endpoint == "https://api.anthropic.com:443"
    assert normalise_endpoint("http://[::1]/v1//") == "http://[::1]:80/v1"
    with pytest.raises(ConfigError):
        normalise_endpoint("http://h/v1?key=x")


def test_seed_is_stable_per_trace_and_attempt() -> None:
    assert seed_for("t", 0, 0) == seed_for("t", 0, 0)
    assert len({seed_for("t", 0, 0), seed_for("t", 1, 0), seed_for("u", 0, 0), seed_for("t", 0, 1)}) == 4
    assert 0 <= seed_for("t", 0, 0) < 2 ** 31


# ---- retries --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BOTH)
async def test_429_with_retry_after_then_success(fake: FakeLlmApis, name: str) -> None:
    api = APIS[name]
    limited = (openai_error(429, "Rate limit reached", "requests", "rate_limit_exceeded",
                            **{"Retry-After": "0"})
               if name == "openai" else
               anthropic_error(429, "rate_limit_error", "Number of requests has exceeded your rate limit",
                               **{"retry-after": "0"}))
    began = time.monotonic()
    result = await run(api, fake, limited, api.ok(GOOD), backoff_s=30.0)  # Retry-After wins
    assert time.monotonic() - began < 5
    assert result.grades["A"] == 3
    assert len(fake.received) == 2


async def test_openai_retry_after_ms(fake: FakeLlmApis) -> None:
    limited = openai_error(429, "slow down", "requests", "rate_limit_exceeded", **{"retry-after-ms": "5"})
    assert (await run(APIS["openai"], fake, limited, openai_ok(GOOD), backoff_s=30.0)).grades["A"] == 3


@pytest.mark.parametrize("name", BOTH)
async def test_500_then_success(fake: FakeLlmApis, name: str) -> None:
    api = APIS[name]
    result = await run(api, fake, api.error(500, "internal error"), api.error(503, "busy"), api.ok(GOOD))
    assert result.ordering[0] == ("A",)
    assert len(fake.received) == 3


async def test_anthropic_529_overloaded_then_success(fake: FakeLlmApis) -> None:
    overloaded = anthropic_error(529, "overloaded_error", "Overloaded")
    result = await run(APIS["anthropic"], fake, overloaded, anthropic_ok(GOOD))
    assert result.grades["A"] == 3
    assert len(fake.received) == 2


@pytest.mark.parametrize("name", BOTH)
async def test_garbage_body_is_retried(fake: FakeLlmApis, name: str) -> None:
    api = APIS[name]
    garbage = Reply(200, raw=b"<html><body>502 upstream</body></html>", content_type="text/html")
    assert (await run(api, fake, garbage, api.ok(GOOD))).grades["A"] == 3
    fake.reset()
    message = await fails(api, fake, garbage, garbage, garbage)
    assert message.count("body is not JSON (text/html") == 3


@pytest.mark.parametrize("name", BOTH)
async def test_unparseable_every_time_fails_with_the_reasons(fake: FakeLlmApis, name: str) -> None:
    api = APIS[name]
    message = await fails(api, fake, api.ok(BAD), api.ok("I cannot decide."), api.ok(BAD), max_attempts=3)
    assert len(fake.received) == 3
    assert "failed after 3 attempt(s)" in message
    assert "1: not a judgement: grade for A is 7, outside 0-3" in message
    assert "2: not a judgement: no JSON object with 'grades'" in message
    assert "3: not a judgement: grade for A is 7" in message


async def test_a_bad_reply_then_a_good_one(fake: FakeLlmApis) -> None:
    result = await run(APIS["openai"], fake, openai_ok(BAD), openai_ok(GOOD))
    assert result.grades["A"] == 3
    seeds = [seen.json["seed"] for seen in fake.received]
    assert seeds == [seed_for("trace-1", 0, 0), seed_for("trace-1", 0, 1)]


@pytest.mark.parametrize("name", BOTH)
async def test_slow_answer_times_out(fake: FakeLlmApis, name: str) -> None:
    api = APIS[name]
    slow = api.ok(GOOD)
    slow.delay_s = 0.5
    message = await fails(api, fake, slow, slow, timeout_s=0.1, max_attempts=2)
    assert message.count("no answer within 0.1s") == 2


async def test_connect_error_is_retried_then_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    judge = OpenAIJudge(OpenAIJudgeConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m",
                                          max_attempts=2, backoff_s=0.01, timeout_s=2))
    async with started(judge):
        with pytest.raises(JudgeFailed) as info:
            await judge.judge(request())
    assert str(info.value).count("ClientConnectorError") == 2


@pytest.mark.parametrize("name", BOTH)
async def test_max_tokens_cut_is_named(fake: FakeLlmApis, name: str) -> None:
    cut = '{"grades": {"A": 3, "B": 1'
    reply = openai_ok(cut, finish_reason="length") if name == "openai" else anthropic_ok(
        cut, stop_reason="max_tokens")
    message = await fails(APIS[name], fake, reply, max_attempts=1)
    assert "finish_reason=length" in message or "stop_reason=max_tokens" in message


async def test_openai_refusal_is_a_failed_attempt(fake: FakeLlmApis) -> None:
    message = await fails(APIS["openai"], fake, openai_ok(None, refusal="I can't help with that."),
                          max_attempts=1)
    assert "model refused: I can't help with that." in message


# ---- errors that are not retried ------------------------------------------------------------


async def test_openai_401_fails_at_once_without_the_key(fake: FakeLlmApis,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = openai_error(401, f"Incorrect API key provided: {KEY}. You can find your API key at "
                              "https://platform.openai.com/account/api-keys.", "invalid_request_error",
                         "invalid_api_key")
    message = await fails(APIS["openai"], fake, wrong)
    assert len(fake.received) == 1
    assert "HTTP 401: invalid_request_error, invalid_api_key: Incorrect API key provided: ***" in message
    assert KEY not in message and KEY not in caplog.text


async def test_anthropic_401_fails_at_once(fake: FakeLlmApis) -> None:
    message = await fails(APIS["anthropic"], fake,
                          anthropic_error(401, "authentication_error", "invalid x-api-key"))
    assert len(fake.received) == 1
    assert "1: HTTP 401: authentication_error: invalid x-api-key" in message


async def test_vllm_flat_error_body(fake: FakeLlmApis) -> None:
    message = await fails(APIS["openai"], fake,
                          vllm_flat_error(400, "The model `judge-model` does not exist."))
    assert "HTTP 400: BadRequestError, 400: The model `judge-model` does not exist." in message


async def test_key_never_in_retry_logs(fake: FakeLlmApis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = anthropic_error(529, "overloaded_error", f"Overloaded (key {KEY})")
    message = await fails(APIS["anthropic"], fake, echo, echo, max_attempts=2)
    assert "overloaded_error" in message and "retrying" in caplog.text
    assert KEY not in message and KEY not in caplog.text


# ---- lifecycle ------------------------------------------------------------------------------


async def test_anthropic_needs_a_key(fake: FakeLlmApis) -> None:
    with pytest.raises(ConfigError, match="api_key"):
        await make_anthropic(fake, api_key=None).start()


async def test_judge_before_start_fails(fake: FakeLlmApis) -> None:
    with pytest.raises(JudgeFailed, match="not started"):
        await make_openai(fake).judge(request())


async def test_start_and_close_are_idempotent(fake: FakeLlmApis) -> None:
    judge = make_openai(fake)
    await judge.start()
    await judge.start()
    await judge.close()
    await judge.close()


async def test_cancellation_propagates(fake: FakeLlmApis) -> None:
    slow = openai_ok(GOOD)
    slow.delay_s = 0.5
    fake.script(APIS["openai"].path, slow)
    async with started(make_openai(fake)) as judge:
        task = asyncio.create_task(judge.judge(request()))
        assert await asyncio.to_thread(fake.arrived.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_backoff_and_retry_after() -> None:
    assert [backoff_delay(n, 0.5, None) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert backoff_delay(3, 0.5, 0.0) == 0.0
    assert backoff_delay(1, 0.5, 3600) == 60.0
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert retry_after_s({}) is None


async def test_proxy_html_error_is_read_as_text(fake: FakeLlmApis) -> None:
    html = Reply(502, raw=b"<html><head><title>502 Bad Gateway</title></head><body><center>"
                          b"<h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>",
                 content_type="text/html")
    message = await fails(APIS["openai"], fake, html, max_attempts=1)
    assert "1: HTTP 502: 502 Bad Gateway 502 Bad Gateway nginx" in message
