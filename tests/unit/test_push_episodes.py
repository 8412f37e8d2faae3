"""POST /v1/episodes: 200 when every line is stored, 207 per line when some fail, clear 4xx else."""

from __future__ import annotations

import json

import httpx
import pytest

from schemas import Episode, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from tests.support.fakes import StaticProvider
from tests.support.records import all_examples

EPISODE = next(m for m in all_examples() if isinstance(m, Episode))


def _line(episode_id: str) -> bytes:
    return EPISODE.model_copy(update={"episode_id": episode_id}).to_bytes()


@pytest.fixture
async def client_and_stored():
    settings = GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"), providers=[BM25Config(name="x")],
                               max_push_lines=5, max_push_bytes=20_000, max_line_bytes=4_000)
    gw = build_gateway(settings, bus=Bus(settings.kafka), providers=[StaticProvider("a")])
    stored: list[Episode] = []

    async def collect(ep: Episode) -> None:
        stored.append(ep)

    gw.bus.subscribe(topic("episodes"), collect, group_id="t")
    await gw.start()
    app = create_app(settings, gateway=gw)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c, stored
    await gw.stop()


async def test_fully_valid_batch_is_200(client_and_stored):
    c, stored = client_and_stored
    r = await c.post("/v1/episodes", content=_line("e1") + b"\n" + _line("e2") + b"\n")
    assert r.status_code == 200
    assert r.json()["stored"] == 2 and [x["status"] for x in r.json()["results"]] == [201, 201]
    assert [e.episode_id for e in stored] == ["e1", "e2"]


async def test_partial_failure_is_207_with_line_numbers_and_reasons(client_and_stored):
    c, stored = client_and_stored
    bad_version = json.loads(_line("e9")) | {"schema_version": 4}
    body = b"\n".join([_line("e1"), b"{not json", b"", json.dumps(bad_version).encode(),
                       b'{"schema_version": 1, "episode_id": "x"}', _line("e2")])
    r = await c.post("/v1/episodes", content=body)
    assert r.status_code == 207
    res = {x["line"]: x for x in r.json()["results"]}
    assert sorted(res) == [1, 2, 4, 5, 6]  # the blank line 3 is not an item
    assert res[1]["status"] == 201 and res[6]["status"] == 201
    assert res[2]["status"] == 422 and "not valid JSON" in res[2]["error"]
    assert res[4]["status"] == 422 and "schema_version 4" in res[4]["error"]
    assert res[5]["status"] == 422 and "created_at: Field required" in res[5]["error"]
    assert [e.episode_id for e in stored] == ["e1", "e2"]  # valid lines stored, nothing else


async def test_nothing_valid_is_422_and_empty_is_400(client_and_stored):
    c, stored = client_and_stored
    r = await c.post("/v1/episodes", content=b"[1]\n{}")
    assert r.status_code == 422 and r.json()["stored"] == 0
    r = await c.post("/v1/episodes", content=b"\n \n")
    assert r.status_code == 400 and "no episode" in r.json()["reason"]
    assert stored == []


async def test_limits(client_and_stored):
    c, stored = client_and_stored
    r = await c.post("/v1/episodes", content=b"\n".join(_line(f"e{i}") for i in range(6)))
    assert r.status_code == 413 and "6 episodes; the limit is 5" in r.json()["reason"]
    r = await c.post("/v1/episodes", content=b"x" * 30_000)
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    huge = json.loads(_line("big"))
    huge["messages"][1]["content"] = "q" * 5_000
    r = await c.post("/v1/episodes", content=_line("ok") + b"\n" + json.dumps(huge).encode())
    assert r.status_code == 207 and r.json()["results"][1]["status"] == 413
    assert [e.episode_id for e in stored] == ["ok"]
