"""The router client against a real loopback server speaking OpenAI chat completions: every way an
answer can fail is a RouterError whose ``kind`` the gateway counts its fallbacks by."""

from __future__ import annotations

import socket

import pytest

from services.common.prompt import system_prompt
from services.router.client import (
    RouterClient,
    RouterError,
    RouterTimeout,
    RouterUnparseable,
)
from tests.support.http_fake import Reply, ScriptedServer, chat_completion

PROVIDERS = ("bm25-all", "dense-all", "bio-dense")
PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    with ScriptedServer("fake-router") as srv:
        yield srv


@pytest.fixture
async def client(server):
    server.reset()
    async with RouterClient(server.url(), timeout_s=0.5, max_tokens=32, api_key="k") as c:
        yield c


async def test_ok_answer_is_parsed_and_the_request_is_the_training_conversation(server, client):
    server.script(PATH, chat_completion("```\nbio-dense > bm25-all = dense-all\n```"))
    answer = await client.route("router@3", PROVIDERS, "what is a cell")
    assert answer.ordering == ("bio-dense", "bm25-all", "dense-all")
    assert answer.parsed.tiers == (("bio-dense",), ("bm25-all", "dense-all"))
    assert answer.raw.startswith("```") and answer.latency_ms > 0
    [req] = server.received
    assert req.headers["authorization"] == "Bearer k"
    assert req.json == {"model": "router@3", "max_tokens": 32, "temperature": 0.0, "messages": [
        {"role": "system", "content": system_prompt(PROVIDERS)}, {"role": "user", "content": "what is a cell"}]}


@pytest.mark.parametrize("reply, error, match", [
    (Reply(500, {"error": "boom"}), RouterError, "HTTP 500"),
    (Reply(404, {"object": "error", "message": "The model `router@9` does not exist.", "code": 404}),
     RouterError, "HTTP 404.*does not exist"),
    (Reply(200, raw=b"<html>not json"), RouterError, "not a chat completion"),
    (Reply(200, {"choices": []}), RouterError, "not a chat completion"),
    (chat_completion(None), RouterError, "content is NoneType"),
    (chat_completion("I would use google."), RouterUnparseable, "no known provider"),
])
async def test_failures_are_router_errors_with_their_kind(server, client, reply, error, match):
    server.script(PATH, reply)
    with pytest.raises(error, match=match) as info:
        await client.route("router@9", PROVIDERS, "q")
    assert type(info.value) is error
    assert info.value.kind == ("unparseable" if error is RouterUnparseable else "router_error")
    if error is RouterUnparseable:
        assert info.value.raw == "I would use google."  # what the model wrote goes on the trace


async def test_slow_router_is_a_timeout(server, client):
    server.script(PATH, Reply(200, {"late": True}, delay_s=3.0))
    with pytest.raises(RouterTimeout, match="within 0.5s") as info:
        await client.route("router@1", PROVIDERS, "q")
    assert info.value.kind == "router_timeout" and isinstance(info.value, TimeoutError)


async def test_unreachable_router_is_a_router_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with RouterClient(f"http://127.0.0.1:{port}", timeout_s=2.0) as c:
        with pytest.raises(RouterError, match="unreachable") as info:
            await c.route("router@1", PROVIDERS, "q")
    assert info.value.kind == "router_error"


def test_bad_client_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        RouterClient("http://x", timeout_s=0)
