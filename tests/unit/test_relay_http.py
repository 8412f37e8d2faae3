"""The relay's HTTP surface against a counting stand-in for the sampler: one-episode credentials (each
refusal a 401/403 with a reason and no sampler call), the admin routes, user agents never blocked, and
a 4xx with the project's error body for bad requests to every route."""

from __future__ import annotations

import httpx
import pytest

from services.relay.credentials import MemoryCredentialStore, token_of
from tests.support.relay import counting_sampler, relay_served, relay_settings
from tests.support.tiny_model import build_tiny_model

ADMIN = "admin-secret-for-tests"
HELLO = {"model": "policy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
HELLO_ANTHROPIC = {"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("relay-http") / "base")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def relay(tiny):
    """(client, sampler fake, credential store, clock) with credentials on and the admin routes open."""
    fake, clock = counting_sampler(), Clock()
    store = MemoryCredentialStore(clock=clock)
    settings = relay_settings(tiny, admin_token=ADMIN, max_tokens_limit=64, default_max_tokens=8, max_body_bytes=4096)
    async with relay_served(settings, fake, credentials=store) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client, fake, store, clock


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_refused(r: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == kind and body["reason"] and body["message"] == body["reason"], body  # 413, 405 too
    for w in words:
        assert w in body["reason"], body["reason"]


# ------------------------------------------------------------------------------ credentials
async def test_a_token_opens_its_episode_both_ways_each_sdk_sends_it(relay):
    client, fake, store, _ = relay
    token = await store.mint("ep-1", 60)
    r = await client.post("/tr/ep-1/v1/chat/completions", json=HELLO, headers=bearer(token))
    assert r.status_code == 200, r.text
    r = await client.post("/tr/ep-1/v1/messages", json=HELLO_ANTHROPIC, headers={"x-api-key": token})
    assert r.status_code == 200, r.text
    r = await client.get("/tr/ep-1/v1/models", headers={"x-api-key": token})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-base"
    assert len(fake.state.hits) == 2


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/models"])
async def test_each_refusal_has_its_status_and_reason_and_never_reaches_the_sampler(relay, route):
    client, fake, store, clock = relay
    own = await store.mint("ep-1", 60)
    other = await store.mint("ep-2", 60)
    expired = await store.mint("ep-1", 5, tombstone_s=3600)
    revoked = await store.mint("ep-1", 60)
    assert await store.revoke(revoked)
    clock.now += 10  # `expired` is now past its ttl, still within its tombstone
    body = HELLO_ANTHROPIC if route == "/v1/messages" else HELLO
    method = "GET" if route == "/v1/models" else "POST"

    async def send(headers: dict[str, str]) -> httpx.Response:
        return await client.request(method, f"/tr/ep-1{route}", json=None if method == "GET" else body,
                                    headers=headers)

    assert_refused(await send({}), 401, "unauthenticated", "Authorization: Bearer", "x-api-key")
    assert_refused(await send(bearer("sk-not-ours")), 401, "malformed_credential")
    assert_refused(await send({"authorization": "Basic dXNlcjpwYXNz"}), 401, "malformed_credential")
    assert_refused(await send({"x-api-key": "frt_" + "A" * 43}), 401, "unknown_credential")
    assert_refused(await send(bearer(expired)), 401, "expired_credential", "expired")
    assert_refused(await send({"x-api-key": revoked}), 401, "revoked_credential")
    assert_refused(await send(bearer(other)), 403, "forbidden", "another episode")
    r = await send(bearer("frt_" + "A" * 43))
    assert r.headers["www-authenticate"] == "Bearer"
    assert fake.state.hits == []  # not one refusal reached the sampler
    assert (await send(bearer(own))).status_code == 200


async def test_a_token_opens_nothing_but_its_episode(relay):
    client, fake, store, _ = relay
    token = await store.mint("ep-1", 60)
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/tr/ep-1/v1/completions"), ("POST", "/tr/ep-1/v1/load_lora_adapter"),
                         ("GET", "/tr/ep-1/v1/adapters"), ("POST", "/v1/adapters/router/versions"),
                         ("GET", "/tr/ep-1/calls")]:
        r = await client.request(method, path, json=HELLO, headers=bearer(token))
        assert r.status_code in (404, 405), (path, r.status_code)
        assert r.json()["error"] in ("not_found", "method_not_allowed") and r.json()["reason"]
    assert_refused(await client.get("/tr/ep-1/../ep-2/v1/models", headers=bearer(token)), 403, "forbidden")
    for path in ("/admin/v1/credentials", "/admin/v1/credentials/revoke", "/admin/v1/episodes/ep-1/end"):
        assert_refused(await client.post(path, json={"trace_id": "ep-1"}, headers=bearer(token)), 403, "forbidden")
    assert fake.state.hits == []


async def test_the_admin_routes_mint_revoke_and_refuse(relay):
    client, fake, _, _ = relay
    assert_refused(await client.post("/admin/v1/credentials", json={"trace_id": "ep-9"}), 401, "unauthenticated")
    assert_refused(await client.post("/admin/v1/credentials", json={"trace_id": "ep-9"}, headers=bearer("nope")),
                   403, "forbidden")
    r = await client.post("/admin/v1/credentials", json={"trace_id": "ep-9", "ttl_s": 30}, headers=bearer(ADMIN))
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    assert r.json()["base_path"] == "/tr/ep-9"
    assert (await client.post("/tr/ep-9/v1/chat/completions", json=HELLO, headers=bearer(token))).status_code == 200
    r = await client.post("/admin/v1/credentials/revoke", json={"token": token}, headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json() == {"revoked": True}
    assert_refused(await client.post("/tr/ep-9/v1/chat/completions", json=HELLO, headers=bearer(token)),
                   401, "revoked_credential")
    assert len(fake.state.hits) == 1


async def test_the_admin_routes_do_not_exist_without_an_admin_token(tiny):
    async with relay_served(relay_settings(tiny), counting_sampler()) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            assert_refused(await client.post("/admin/v1/credentials", json={"trace_id": "x"}, headers=bearer("x")),
                           404, "not_found", "FANROUTE_ADMIN_TOKEN")


@pytest.mark.parametrize("agent", ["OpenAI/Python 1.99.0", "Anthropic/Python 0.60.0", "claude-cli/1.0.80 (external, cli)",
                                   "codex_cli_rs/0.20.0", "curl/8.5.0", "python-requests/2.32", "Go-http-client/1.1",
                                   "", "Mozilla/5.0 (compatible; Googlebot/2.1)", "bot", "x" * 2000])
async def test_no_user_agent_is_ever_blocked(relay, agent):
    client, fake, store, _ = relay
    token = await store.mint("ep-ua", 60)
    r = await client.post("/tr/ep-ua/v1/chat/completions", json=HELLO,
                          headers={**bearer(token), "user-agent": agent, "x-stainless-lang": "python"})
    assert r.status_code == 200, r.text


def test_token_of_reads_each_sdks_header():
    assert token_of("Bearer frt_abc", None) == "frt_abc"
    assert token_of("bearer   frt_abc ", None) == "frt_abc"
    assert token_of(None, "frt_key") == "frt_key"
    assert token_of("Bearer a", "b") == "b"
    assert token_of(None, None) is None and token_of("Bearer ", None) == "Bearer"


# ------------------------------------------------------------------------------ bad requests
CHAT_BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "p", "messages": []}, "messages"),
    ({"model": "p", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000}, "max_tokens"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "p", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 40}, "stop"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0}, "presence_penalty"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "p", "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"model": "p", "messages": [{"role": "assistant", "content": "x",
                                  "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]}, "messages"),
]
MESSAGES_BAD = [
    ({"model": "p", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "messages"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences"),
    ({"model": "p", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "search", "input_schema": {"type": "object"}}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_BAD)
async def test_bad_chat_completions_are_400_with_a_reason(relay, body, param):
    client, fake, store, _ = relay
    r = await client.post("/tr/ep-1/v1/chat/completions", json=body, headers=bearer(await store.mint("ep-1", 60)))
    assert r.status_code == 400, r.text
    assert r.json()["error"] in ("invalid_request", "unsupported_conversation") and r.json()["reason"]
    assert r.json().get("param") == param, r.json()
    assert fake.state.hits == []


@pytest.mark.parametrize(("body", "param"), MESSAGES_BAD)
async def test_bad_messages_are_400_with_a_reason(relay, body, param):
    client, fake, store, _ = relay
    r = await client.post("/tr/ep-1/v1/messages", json=body, headers={"x-api-key": await store.mint("ep-1", 60)})
    assert r.status_code == 400, r.text
    assert r.json()["reason"] and r.json().get("param") == param, r.json()
    assert fake.state.hits == []


async def test_tool_definitions_are_refused_naming_the_template(relay):
    client, _, store, _ = relay
    body = {**HELLO, "tools": [{"type": "function", "function": {"name": "search"}}]}
    r = await client.post("/tr/ep-1/v1/chat/completions", json=body, headers=bearer(await store.mint("ep-1", 60)))
    assert_refused(r, 400, "unsupported_conversation", "tool definitions", "chat template")


async def test_malformed_bodies_and_paths_on_every_route(relay):
    client, fake, store, _ = relay
    token = await store.mint("ep-1", 60)
    auth = {**bearer(token), "content-type": "application/json"}
    for path in ("/tr/ep-1/v1/chat/completions", "/tr/ep-1/v1/messages"):
        assert_refused(await client.post(path, content=b"{nope", headers=auth), 400, "invalid_json", "JSON")
        assert_refused(await client.post(path, content=b"[1, 2]", headers=auth), 400, "invalid_request", "object")
        assert_refused(await client.post(path, content=b"x" * 5000, headers=auth), 413, "body_too_large")
        assert_refused(await client.get(path, headers=auth), 405, "method_not_allowed")
    for path in ("/tr/bad%20id/v1/chat/completions", "/tr/bad%20id/v1/messages", "/tr/-x/v1/models"):
        r = await client.request("GET" if path.endswith("models") else "POST", path, json=HELLO, headers=auth)
        assert_refused(r, 400, "invalid_trace_id")
    admin = bearer(ADMIN)
    assert_refused(await client.post("/admin/v1/credentials", json={"trace_id": "a b"}, headers=admin),
                   400, "invalid_request", "trace_id")
    assert_refused(await client.post("/admin/v1/credentials", json={"trace_id": "ok", "ttl_s": -1}, headers=admin),
                   400, "invalid_request", "ttl_s")
    assert_refused(await client.post("/admin/v1/credentials", content=b"{", headers=admin), 400, "invalid_json")
    assert_refused(await client.post("/admin/v1/credentials/revoke", json={}, headers=admin), 400, "invalid_request")
    assert_refused(await client.post("/admin/v1/credentials/revoke", json={"token": "frt_x"}, headers=admin),
                   404, "unknown_credential")
    assert_refused(await client.post("/admin/v1/episodes/never/end", headers=admin), 404, "unknown_episode")
    assert_refused(await client.post("/admin/v1/episodes/ep-1/end", json={"advantage": "x"}, headers=admin),
                   400, "invalid_request", "advantage")
    assert fake.state.hits == []


async def test_a_sampler_that_does_not_answer_is_503_and_one_that_answers_nonsense_502(tiny):
    from fastapi import FastAPI

    from tests.support.serving import free_port

    store = MemoryCredentialStore()
    settings = relay_settings(tiny, sampler_url=f"http://127.0.0.1:{free_port()}", sampler_timeout_s=5)
    async with relay_served(settings, credentials=store) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            auth = bearer(await store.mint("ep-1", 60))
            assert_refused(await client.post("/tr/ep-1/v1/chat/completions", json=HELLO, headers=auth),
                           503, "sampler_unavailable", "did not answer")
            assert_refused(await client.get("/tr/ep-1/v1/models", headers=auth), 503, "sampler_unavailable")
            r = await client.put("/tr/ep-1/v1/messages", headers=auth)
            assert_refused(r, 405, "method_not_allowed")
            assert r.headers["allow"] == "POST"
    nonsense = FastAPI()
    nonsense.get("/v1/models")(lambda: {"data": []})
    store = MemoryCredentialStore()
    async with relay_served(relay_settings(tiny), nonsense, credentials=store) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/tr/ep-1/v1/chat/completions", json=HELLO, headers=bearer(await store.mint("ep-1", 60)))
            assert_refused(r, 502, "sampler_unusable", "no model")
