"""Routed mode of the gateway on the in-memory bus, with fake providers and a real loopback router
server: the slice fans out, the router's top provider answers (the next on failure), and every way
the router can fail is a counted fallback to the best single provider."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest
from pydantic import ValidationError

from schemas import AdapterPublished, Trace, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import MemoryStampStore
from services.gateway.app import Gateway, build_gateway, create_app
from services.gateway.settings import GatewaySettings, RoutingSettings
from services.providers.base import Provider
from services.providers.config import BM25Config
from services.router.client import RouterClient
from services.router.policy import in_fanout_slice
from tests.support.fakes import StaticProvider, failing
from tests.support.http_fake import Reply, ScriptedServer, chat_completion

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def router():
    with ScriptedServer("fake-router") as srv:
        yield srv


def settings_for(router_url: str | None, providers: tuple[str, ...] = ("a", "b", "c"), *,
                 deadline_s: float = 10.0, **routing) -> GatewaySettings:
    routing = {"enabled": True, "router_url": router_url, "fanout_fraction": 0.0, "router_timeout_s": 0.5,
               "mode": "generate", **routing}  # the fake router writes orderings (scoring: test_router_scoring.py)
    return GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                           providers=[BM25Config(name=n) for n in providers], deadline_s=deadline_s,
                           routing=routing)


@dataclass
class Routed:
    """One running routed gateway and what the test looks at."""

    gw: Gateway
    client: httpx.AsyncClient
    traces: list[Trace]
    providers: dict[str, StaticProvider]
    stamps: MemoryStampStore

    async def promote(self, version: int, fallback_provider: str | None = None) -> None:
        await self.gw.bus.publish(topic("adapters"), AdapterPublished(
            model_id="router", version=version, base_model="tiny", url=f"http://publisher/v{version}",
            files_sha256={}, published_at=datetime.now(UTC), promoted=True, fallback_provider=fallback_provider))
        await self.gw.routed.follower.wait_for(lambda p: p is not None and p.version == version, 5)

    async def search(self, query: str = "what is a cell", **kw) -> dict:
        r = await self.client.post("/v1/search", json={"query": query, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    async def metric(self, line: str) -> bool:
        return line in (await self.client.get("/metrics")).text


@pytest.fixture
async def make(router):
    """Start a routed gateway: ``await make(providers=[...], **routing settings)``."""
    router.reset()
    running: list[Gateway] = []

    async def start(providers: list[Provider] | None = None, *, router_client: RouterClient | None = None,
                    deadline_s: float = 10.0, **routing) -> Routed:
        providers = providers or [StaticProvider("a", ("u1", "u2")), StaticProvider("b", ("u2", "u3")),
                                  StaticProvider("c", ("u4",))]
        settings = settings_for(router.url(), tuple(p.name for p in providers), deadline_s=deadline_s, **routing)
        stamps = MemoryStampStore()
        gw = build_gateway(settings, bus=Bus(settings.kafka), providers=providers, stamps=stamps,
                           router_client=router_client)
        traces: list[Trace] = []

        async def on_trace(t: Trace) -> None:
            traces.append(t)

        gw.bus.subscribe(topic("traces"), on_trace, group_id="test")
        await gw.start()
        running.append(gw)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, gateway=gw)),
                                   base_url="http://gw")
        return Routed(gw, client, traces, {p.name: p for p in providers}, stamps)

    yield start
    for gw in running:
        await gw.stop()


def _keys(inside: bool, fraction: float, n: int) -> list[str]:
    """``n`` request ids that fall in (or out of) the fan-out slice of ``fraction``."""
    return [k for k in (f"req-{i}" for i in range(1000)) if in_fanout_slice(k, fraction) == inside][:n]


async def test_router_top_provider_alone_answers(make, router):
    rt = await make()
    await rt.promote(1)
    router.script(CHAT, chat_completion("Here you go:\nb > a = c"))
    body = await rt.search(query_id="med/1")
    assert body["mode"] == "routed"
    assert [c["provider"] for c in body["candidates"]] == ["b"]
    assert body["route"]["router"] == "router@1" and body["route"]["ordering"] == ["b", "a", "c"]
    assert body["route"]["called"] == ["b"] and body["route"]["fallback"] is None
    assert body["route"]["raw"] == "Here you go:\nb > a = c" and body["route"]["router_ms"] > 0
    assert [f["url"] for f in body["fused"]] == ["u2", "u3"] and body["signals"]["contested"] is False
    assert rt.providers["b"].calls == ["what is a cell"] and rt.providers["a"].calls == rt.providers["c"].calls == []
    [trace] = rt.traces
    assert trace.mode == "routed" and trace.router_version == "router@1" and trace.route.called == ("b",)
    assert trace.trace_id == body["trace_id"] and [c.provider for c in trace.candidates] == ["b"]
    [req] = router.received
    assert req.json["model"] == "router@1" and req.json["max_tokens"] == 48
    assert "The providers are: a, b, c." in req.json["messages"][0]["content"]
    assert await rt.metric('fanroute_gateway_routed_total{path="router"} 1.0')
    assert await rt.metric('fanroute_gateway_requests_total{mode="routed",status="ok"} 1.0')
    assert await rt.metric("fanroute_gateway_router_version 1.0")
    assert await rt.metric("fanroute_gateway_router_seconds_count 1.0")


async def test_the_routed_trace_records_the_adapter_content_the_router_named(make, router):
    from dataclasses import replace

    from services.common.adapter_files import ADAPTER_SHA256_HEADER

    rt = await make()
    await rt.promote(1)
    digest = "ab" * 32
    router.script(CHAT, replace(chat_completion("b > a > c"), headers={ADAPTER_SHA256_HEADER: digest}),
                  chat_completion("a > b > c"))  # a server that names nothing (vLLM)
    named = await rt.search(query_id="med/1", request_id="named")
    unnamed = await rt.search(query_id="med/2", request_id="unnamed")
    assert named["route"]["router_sha256"] == digest and unnamed["route"]["router_sha256"] is None
    assert [t.route.router_sha256 for t in rt.traces] == [digest, None]


async def test_the_slice_fans_out_by_request_id_and_the_rest_is_routed(make, router):
    rt = await make(fanout_fraction=0.3)
    await rt.promote(2)
    inside, outside = _keys(True, 0.3, 3), _keys(False, 0.3, 3)
    router.script(CHAT, *(chat_completion("c > a > b") for _ in outside))
    modes = {}
    for key in inside + outside:
        body = await rt.search(request_id=key, query_id="same-query")  # request id wins over query id
        modes[key] = (body["mode"], len(body["candidates"]), body["route"] is None)
    assert all(modes[k] == ("fanout", 3, True) for k in inside)
    assert all(modes[k] == ("routed", 1, False) for k in outside)
    assert len(router.received) == len(outside)  # the slice never asks the router
    assert [t.mode for t in rt.traces] == ["fanout"] * 3 + ["routed"] * 3
    assert await rt.metric('fanroute_gateway_requests_total{mode="fanout",status="ok"} 3.0')


async def test_the_slice_key_is_the_query_id_without_a_request_id(make, router):
    rt = await make(fanout_fraction=0.5)
    qid = _keys(True, 0.5, 1)[0]
    assert [(await rt.search(query_id=qid))["mode"] for _ in range(2)] == ["fanout", "fanout"]


async def test_failover_to_the_next_provider_when_the_top_one_fails(make, router):
    rt = await make([failing("a"), StaticProvider("b", ("u2",)), StaticProvider("c", ("u3",))])
    await rt.promote(1)
    router.script(CHAT, chat_completion("a > c > b"))
    body = await rt.search()
    assert body["route"]["called"] == ["a", "c"] and body["route"]["fallback"] is None
    assert [(c["provider"], c["error_kind"]) for c in body["candidates"]] == [("a", "error"), ("c", None)]
    assert [f["url"] for f in body["fused"]] == ["u3"] and body["signals"]["providers_failed"] == 1
    assert rt.providers["b"].calls == []
    assert await rt.metric("fanroute_gateway_route_failovers_total 1.0")
    assert await rt.metric('fanroute_provider_calls_total{outcome="error",provider="a"} 1.0')


async def test_max_attempts_bounds_the_failover(make, router):
    rt = await make([failing("a"), failing("b"), StaticProvider("c", ("u3",))], max_attempts=2)
    await rt.promote(1)
    router.script(CHAT, chat_completion("a > b > c"))
    body = await rt.search()
    assert body["route"]["called"] == ["a", "b"] and body["fused"] == []  # an answer, not an error
    assert rt.providers["c"].calls == []


async def test_the_deadline_cuts_a_hanging_provider_and_stops_the_failover(make, router):
    gate = asyncio.Event()  # never set: provider a hangs past the request deadline
    rt = await make([StaticProvider("a", ("u1",), gate=gate), StaticProvider("b", ("u2",))],
                    deadline_s=0.6, router_timeout_s=0.3)
    await rt.promote(1)
    router.script(CHAT, chat_completion("a > b"))
    body = await rt.search()
    assert body["route"]["called"] == ["a"]
    [cand] = body["candidates"]
    assert cand["error_kind"] == "deadline" and "0.6s" in cand["error"]


class ExplodingClient(RouterClient):
    """A router client with a bug: the gateway must still answer."""

    async def route(self, *args, **kwargs):
        raise RuntimeError("client bug")


@pytest.mark.parametrize("case, reason", [
    ("nothing promoted", "no_adapter"),
    ("slow router", "router_timeout"),
    ("HTTP 500", "router_error"),
    ("model not found", "router_error"),
    ("garbage body", "router_error"),
    ("client bug", "router_error"),
    ("no known name", "unparseable"),
])
async def test_every_router_failure_is_a_counted_fallback_to_the_best_single_provider(make, router, case, reason):
    replies = {"slow router": Reply(200, {}, delay_s=2.0), "HTTP 500": Reply(500, {"error": "boom"}),
               "model not found": Reply(404, {"message": "The model `router@4` does not exist."}),
               "garbage body": Reply(200, raw=b"\x00\xffnot json"),
               "no known name": chat_completion("I think google is best")}
    client = ExplodingClient("http://unused") if case == "client bug" else None
    rt = await make(router_client=client)
    if case != "nothing promoted":
        await rt.promote(4, fallback_provider="b")
    if case in replies:
        router.script(CHAT, replies[case])
    body = await rt.search()
    route = body["route"]
    assert body["mode"] == "routed" and route["fallback"] == reason
    assert route["fallback_provider"] == route["called"][0] == ("a" if reason == "no_adapter" else "b")
    assert route["ordering"] == [] and [c["provider"] for c in body["candidates"]] == route["called"]
    assert route["router"] == (None if reason == "no_adapter" else "router@4")
    assert route["raw"] == ("I think google is best" if reason == "unparseable" else "")
    [trace] = rt.traces
    assert trace.router_version == route["router"] and trace.route.fallback == reason
    assert await rt.metric(f'fanroute_gateway_route_fallbacks_total{{reason="{reason}"}} 1.0')
    assert await rt.metric('fanroute_gateway_routed_total{path="fallback"} 1.0')
    assert await rt.metric('fanroute_gateway_routed_total{path="router"} 0.0')


async def test_fallback_provider_configured_beats_the_promotions_which_beats_the_first(make, router):
    rt = await make(fallback_provider="c")
    await rt.promote(1, fallback_provider="b")
    router.script(CHAT, Reply(500, {}))
    assert (await rt.search())["route"]["called"] == ["c"]
    rt = await make()
    await rt.promote(1, fallback_provider="not-here")  # measured elsewhere: not one of ours
    router.script(CHAT, Reply(500, {}))
    assert (await rt.search())["route"]["called"] == ["a"]
    assert (await rt.client.get("/healthz")).json()["routing"]["fallback_provider"] == "a"


async def test_a_new_promotion_is_followed_without_restart_and_shown_in_healthz(make, router):
    rt = await make()
    health = (await rt.client.get("/healthz")).json()["routing"]
    assert health["enabled"] is True and health["version"] is None and health["router"] is None
    await rt.promote(1, fallback_provider="b")
    await rt.promote(2, fallback_provider="c")
    await rt.promote(1, fallback_provider="b")  # a rollback is the latest promotion, so it wins
    router.script(CHAT, chat_completion("c > a"))
    assert (await rt.search())["route"]["router"] == "router@1"
    assert (await rt.client.get("/healthz")).json()["routing"] == {
        "enabled": True, "model_id": "router", "version": 1, "router": "router@1", "fallback_provider": "b",
        "fanout_fraction": 0.0}
    assert await rt.metric("fanroute_gateway_router_version 1.0")


async def test_cancelling_a_request_while_the_router_thinks_is_not_swallowed(make, router):
    rt = await make(router_timeout_s=3.0)
    await rt.promote(1)
    router.script(CHAT, Reply(200, {}, delay_s=2.0))
    task = asyncio.create_task(rt.search())
    await asyncio.to_thread(router.arrived.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rt.traces == [] and all(p.calls == [] for p in rt.providers.values())


async def test_routing_off_is_todays_fan_out(router):
    settings = GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                               providers=[BM25Config(name="a")])
    assert settings.routing.enabled is False
    gw = build_gateway(settings, providers=[StaticProvider("a", ("u1",))])
    assert gw.routed is None


@pytest.mark.parametrize("routing, deadline_s, match", [
    ({"enabled": True}, 10.0, "router_url is required"),
    ({"enabled": True, "router_url": "http://r", "fallback_provider": "zzz"}, 10.0, "'zzz' is not an enabled"),
    ({"fallback_provider": "d"}, 10.0, "'d' is not an enabled provider"),  # checked even while off
    ({"enabled": True, "router_url": "http://r", "router_timeout_s": 3.0}, 2.0, "must be below deadline_s"),
    ({"fanout_fraction": 1.5}, 10.0, "fanout_fraction"),
    ({"max_attempts": 0}, 10.0, "max_attempts"),
    ({"router_url": "sampler:8001"}, 10.0, "router_url"),
    ({"model_id": "router/../x"}, 10.0, "model_id"),
    ({"colour": "blue"}, 10.0, "Extra inputs are not permitted"),
    ({"mode": "score", "prompt_logprobs": False}, 10.0, "mode score needs routing.prompt_logprobs"),
    ({"decision": "best-guess"}, 10.0, "decision"),
])
def test_bad_routing_settings_are_clear_errors(routing, deadline_s, match):
    with pytest.raises(ValidationError, match=match):
        GatewaySettings(providers=[BM25Config(name="a"), BM25Config(name="b"), BM25Config(name="d", enabled=False)],
                        deadline_s=deadline_s, routing=routing)


def test_routing_settings_from_env(monkeypatch):
    for key, value in {"ENABLED": "true", "ROUTER_URL": "http://sampler:8001", "FANOUT_FRACTION": "0.25",
                       "FALLBACK_PROVIDER": "web-lexical", "MAX_ATTEMPTS": "3", "GROUP_ID": "gw-1"}.items():
        monkeypatch.setenv(f"FANROUTE_ROUTING__{key}", value)
    r = GatewaySettings().routing
    assert (r.enabled, r.router_url, r.fanout_fraction, r.fallback_provider, r.max_attempts, r.consumer_group) == (
        True, "http://sampler:8001", 0.25, "web-lexical", 3, "gw-1")
    assert RoutingSettings().consumer_group.startswith("fanroute-gateway.")
    assert all(f.description for f in RoutingSettings.model_fields.values())


class _Table:
    """A PublishedRates stand-in holding one version's top-tier table (the publisher path:
    tests/unit/test_router_rates.py)."""

    def __init__(self, table: dict) -> None:
        self.table, self.asked = table, []

    async def get(self, model: str, *, wait_s: float | None = None) -> dict:
        self.asked.append(model)
        return self.table

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(("decision", "chosen"), [("top-tier", "c"), ("first-choice", "a")])
async def test_the_top_tier_decision_sends_an_unsure_query_to_the_generalist(make, router, decision, chosen):
    import math

    from tests.support.http_fake import scored_completion

    table = {"a": {"a": 1.0, "c": 0.8}, "b": {"b": 1.0, "c": 0.8}}
    client = RouterClient(router.url(), mode="score", timeout_s=2.0)
    client.rates = _Table(table)
    rt = await make(router_client=client, mode="score", decision=decision)
    await rt.promote(3)
    router.script("/v1/completions", scored_completion({"a": math.log(0.5), "b": math.log(0.45),
                                                         "c": math.log(0.05)}, model="router@3"))
    body = await rt.search("an unsure query")
    assert body["route"]["called"] == [chosen] and body["route"]["fallback"] is None
    [trace] = rt.traces
    assert trace.route.decision == decision and trace.route.cost_weight == 0.0
