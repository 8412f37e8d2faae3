"""Fault matrix, adapter rows: the sampler's adapters consumer killed with SIGKILL mid-stream and
restarted; the publisher down while an adapter is announced (real broker, real publisher, real CPU
sampler on a tiny random Llama with real PEFT adapters).

A sampler's result for an announcement is the adapter pulled, verified and served. Counted by
content-derived name (``<model_id>@<version>``) in the restarted sampler's ``/v1/models``, and by
pull at the publisher (every manifest request is counted): an adapter verified before the kill is
never pulled again, and only the one being pulled when the kill landed may be pulled twice.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from schemas import topic
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_records_to_end
from services.common.settings import KafkaSettings, RedisSettings
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from services.sampler.worker import VERIFIED_MARKER
from tests.support.fault_matrix import count, exactly_once, report, test_id
from tests.support.poll import eventually
from tests.support.processes import running, service_env
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]
MANIFEST = re.compile(r"/v1/adapters/([^/]+)/versions/(\d+)")
BASE_NAME = "tiny-base"


def _kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=f"fa{uuid.uuid4().hex[:8]}.",
                         transient_backoff_initial_s=0.1, transient_backoff_max_s=0.5, transient_budget_s=120)


def counting(app, pulls: Counter, delay_s: float = 0.0):
    """``app`` with every manifest GET counted per (model id, version); each waits ``delay_s`` first (a slow
    publisher, so that a kill lands mid-stream)."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and (m := MANIFEST.fullmatch(scope["path"])):
            pulls[f"{m.group(1)}@{m.group(2)}"] += 1
            if delay_s:
                await asyncio.sleep(delay_s)
        await app(scope, receive, send)

    return asgi


def _publish(url: str, model_ids: list[str], adapter: Path) -> list[dict]:
    with PublisherClient(url, timeout_s=30) as client:
        return [client.publish(m, adapter, BASE_NAME, {"ndcg": 0.5}) for m in model_ids]


def verified(cache: Path) -> set[str]:
    """``model_id@version`` of every adapter verified into the sampler's cache."""
    return {f"{p.parent.parent.name}@{p.parent.name}" for p in cache.glob(f"*/*/{VERIFIED_MARKER}")}


async def served_adapters(client: httpx.AsyncClient) -> list[str]:
    """The adapters (not the base, not the aliases) the sampler lists; each once per entry it holds."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    return [c["id"] for c in r.json()["data"] if "@" in c["id"]]


async def complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, "prompt": "which provider", "max_tokens": 1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fault-adapters")
    base = build_tiny_model(root / "base")
    return base, build_lora_adapter(base, root / "lora", seed=3)


async def test_sampler_killed_mid_stream_and_restarted_serves_every_adapter_once(
        kafka_bootstrap, redis_url, tmp_path, tiny, request):
    base, adapter = tiny
    kafka = _kafka(kafka_bootstrap)
    n = 24
    model_ids = [f"m{i:02d}" for i in range(n)]
    expected = {f"{m}@1" for m in model_ids}
    pport, sport = free_port(), free_port()
    pub_url = f"http://127.0.0.1:{pport}"
    pulls: Counter = Counter()
    pub = publisher_app(PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url),
                                          storage_dir=tmp_path / "store", public_url=pub_url))
    cache = tmp_path / "cache"
    env = service_env(kafka, redis_url, FANROUTE_BASE_MODEL=str(base), FANROUTE_PORT=str(sport),
                      FANROUTE_ADAPTER_CACHE_DIR=str(cache), FANROUTE_PUBLISHER_URL=pub_url,
                      FANROUTE_GROUP_ID=f"sampler-{uuid.uuid4().hex[:8]}", FANROUTE_MAX_RESIDENT_ADAPTERS="32",
                      FANROUTE_THREADS="1", FANROUTE_KAFKA__TRANSIENT_BACKOFF_INITIAL_S="0.1")
    async with served(counting(pub, pulls, delay_s=0.15), pport, what="publisher", start_timeout_s=60):
        announced = await asyncio.to_thread(_publish, pub_url, model_ids, adapter)
        assert {f"{a['model_id']}@{a['version']}" for a in announced} == expected
        with running("-m", "services.sampler", env=env, crash=True):
            await eventually(lambda: len(verified(cache)) >= 5, timeout_s=120,
                             what="the first sampler to pull 5 adapters")
        before = verified(cache)  # what the killed sampler had verified: never to be pulled again
        pulls_before = sum(pulls.values())
        assert len(before) < n, "the kill must land mid-stream"
        with running("-m", "services.sampler", env=env):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sport}", timeout=30) as client:
                async def all_served() -> list[str] | None:
                    try:
                        got = await served_adapters(client)
                    except httpx.TransportError:
                        return None  # still starting
                    return got if set(got) >= expected else None

                listed = await eventually(all_served, timeout_s=120, what="the restarted sampler to serve all")
                answers = [(await complete(client, m)).status_code for m in model_ids]
    partials = sorted(p.name for p in cache.glob("*/.partial-*"))
    repulled = {name: k for name, k in pulls.items() if k > 1}
    row = exactly_once("kill -9 mid-stream, restart", "sampler adapter worker",
                       test_id(request),
                       records_in=n, expected=expected, results=listed, verified_before_kill=len(before),
                       pulls=sum(pulls.values()), pulls_before_kill=pulls_before, repulled=repulled,
                       partial_dirs_left=len(partials))
    assert answers == [200] * n  # each alias answers with its adapter
    assert set(pulls) == expected
    assert not set(repulled) & before, f"verified before the kill, pulled again: {repulled}"
    assert sum(pulls.values()) - n <= 1, f"more than the in-flight pull repeated: {repulled}"
    assert row.results_out == n and partials == []  # the killed pull's temporary dir is removed at start


async def test_publisher_down_while_an_adapter_is_announced_is_served_after_it_returns(
        kafka_bootstrap, redis_url, tmp_path, tiny, request):
    base, adapter = tiny
    kafka = _kafka(kafka_bootstrap)
    pport, sport = free_port(), free_port()
    pub_url = f"http://127.0.0.1:{pport}"
    pulls: Counter = Counter()
    pub_settings = PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url),
                                     storage_dir=tmp_path / "store", public_url=pub_url)
    async with served(counting(publisher_app(pub_settings), pulls), pport, what="publisher", start_timeout_s=60):
        [announced] = await asyncio.to_thread(_publish, pub_url, ["router"], adapter)
    name = f"router@{announced['version']}"
    # The publisher is down now and the announcement is on the topic: the sampler starts and reads it.
    sampler = sampler_app(SamplerSettings(kafka=kafka, redis=RedisSettings(url=redis_url), base_model=str(base),
                                          adapter_cache_dir=tmp_path / "cache", publisher_url=pub_url,
                                          fetch_timeout_s=5, group_id=f"sampler-{uuid.uuid4().hex[:8]}"))
    outage: list[httpx.Response] = []
    async with (served(sampler, sport, what="sampler", start_timeout_s=120) as url,
                httpx.AsyncClient(base_url=url, timeout=30) as client):
        async def unreachable() -> bool:  # "router" is known once the announcement is read
            outage.append(await complete(client, "router"))
            return outage[-1].status_code == 503
        await eventually(unreachable, timeout_s=60, what="the sampler to read the announcement", interval_s=0.2)
        while_down = [await complete(client, name) for _ in range(3)]  # the version by name too
        assert sampler.state.sampler.registry.get(name) is None
        async with served(counting(publisher_app(pub_settings), pulls), pport, what="publisher again",
                          start_timeout_s=60):
            async def served_now() -> list[str] | None:
                got = await served_adapters(client)
                return got if name in got else None

            listed = await eventually(served_now, timeout_s=60, what=f"{name} served after the publisher returns")
            after = [await complete(client, m) for m in ("router", name)]
    dead = [r async for r in read_records_to_end(kafka, f"{kafka.topic_namespace}{topic('adapters').dlq}")]
    statuses = [r.status_code for r in outage + while_down]
    bodies = [r.json() for r in outage + while_down if r.status_code == 503]
    row = report(count("publisher down while an adapter is announced, then back", "sampler adapter worker",
                       test_id(request), records_in=1, expected={name}, results=listed,
                       answers_while_down=dict(Counter(statuses)), dead_lettered=len(dead),
                       pulls_after_return=sum(pulls.values())))
    assert row.lost == row.duplicates == row.unexpected == 0, row
    assert statuses[-4:] == [503] * 4 and set(statuses) <= {404, 503}  # 404 only before the announcement is read
    assert {b["error"] for b in bodies} == {"adapter_source_unreachable"}
    assert [r.status_code for r in after] == [200, 200]
    assert dead == []
    assert pulls == {name: 1}  # pulled once, after the publisher returned
