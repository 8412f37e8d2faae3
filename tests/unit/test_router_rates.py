"""The top-tier table and the ``top-tier`` decision: counted from the training episodes, read back with
errors that name the field, and deciding differently from the first choice exactly where the router is
unsure between two labels that share a cheaper-to-miss generalist."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from services.common.adapter_files import RATES_FILE
from services.common.publisher_client import PublisherClient
from services.common.settings import KafkaSettings, RedisSettings
from services.publisher.app import create_app
from services.publisher.settings import PublisherSettings
from services.router import linear
from services.router.rates import PublishedRates, RatesError, expected_top_tier, from_json, to_json, top_tier_rates
from services.router.scoring import decide
from tests.support.records import episode
from tests.support.serving import free_port, served

PROVIDERS = ("aero", "biomed", "web")
COST = {"aero": 0.001, "biomed": 0.001, "web": 0.003}


def _episodes() -> list:
    """aero: web ties it 3 times in 4; biomed: web ties it 1 time in 4; two unparseable answers."""
    answers = (["aero = web > biomed"] * 3 + ["aero > web > biomed"]
               + ["biomed = web > aero"] + ["biomed > web > aero"] * 3 + ["", "no ordering here >"])
    return [episode(f"query {i}", a, PROVIDERS, f"q{i}", trace_id=f"t{i}") for i, a in enumerate(answers)]


def test_the_table_counts_how_often_each_provider_shares_the_labels_top_tier() -> None:
    rates = top_tier_rates(_episodes())
    assert rates == {"aero": {"aero": 1.0, "web": 0.75}, "biomed": {"biomed": 1.0, "web": 0.25}}


def test_expected_top_tier_maps_the_belief_over_labels_through_the_table() -> None:
    rates = top_tier_rates(_episodes())
    got = expected_top_tier({"aero": 0.5, "biomed": 0.4, "web": 0.1}, rates)
    assert got["aero"] == pytest.approx(0.5) and got["biomed"] == pytest.approx(0.4)
    assert got["web"] == pytest.approx(0.5 * 0.75 + 0.4 * 0.25 + 0.1)  # an unseen label stands for itself


def test_an_unsure_router_picks_the_generalist_a_sure_one_the_vertical() -> None:
    rates = {"aero": {"aero": 1.0, "web": 0.8}, "biomed": {"biomed": 1.0, "web": 0.8}}
    unsure = {"aero": math.log(0.5), "biomed": math.log(0.45), "web": math.log(0.05)}
    sure = {"aero": math.log(0.97), "biomed": math.log(0.02), "web": math.log(0.01)}
    assert decide(unsure, COST, 0.0)[0] == "aero"  # the first choice: the likeliest label
    assert decide(unsure, COST, 0.0, rates)[0] == "web"  # 0.5·0.8 + 0.45·0.8 + 0.05 = 0.81 > 0.5
    assert decide(sure, COST, 0.0, rates)[0] == "aero"
    # λ prices the generalist's extra cost: at 200 per USD (0.81 − 0.6 < 0.5 − 0.2) back to the vertical
    assert decide(unsure, COST, 200.0, rates)[0] == "aero"


def test_the_document_round_trips_and_bad_ones_name_the_field() -> None:
    rates = top_tier_rates(_episodes())
    doc = to_json(rates, 8)
    assert doc["episodes"] == 8 and from_json(json.loads(json.dumps(doc))) == rates
    with pytest.raises(RatesError, match="not a version-1 fanroute-top-tier-rates"):
        from_json({"format": "something else", "version": 1, "rates": {}})
    with pytest.raises(RatesError, match=r"^rates: "):
        from_json(dict(doc, rates=[1, 2]))
    with pytest.raises(RatesError, match=r"rates\.aero: "):
        from_json(dict(doc, rates={"aero": 0.5}))
    with pytest.raises(RatesError, match=r"rates\.aero\.web: 1\.5 is not a rate"):
        from_json(dict(doc, rates={"aero": {"web": 1.5}}))
    with pytest.raises(ValueError):  # the built-in it also is
        from_json(dict(doc, rates={"aero": {"web": True}}))


def test_the_linear_router_carries_its_table_in_its_artifact(tmp_path: Path) -> None:
    eps = [episode(f"{w} wing flow {i}", "aero = web > biomed", PROVIDERS, f"a{i}", trace_id=f"ta{i}")
           for i, w in enumerate(["supersonic", "shock", "airfoil", "mach", "flutter", "boundary"])]
    eps += [episode(f"{w} cells {i}", "biomed = web > aero" if i == 0 else "biomed > web > aero", PROVIDERS,
                    f"b{i}", trace_id=f"tb{i}")
            for i, w in enumerate(["protein", "tumour", "enzyme", "liver", "heart", "drug"])]
    router = linear.fit(eps, seed=0)
    assert router.rates == {"aero": {"aero": 1.0, "web": 1.0}, "biomed": {"biomed": 1.0, "web": 0.166667}}
    back = linear.from_artifact(json.loads(linear.write_artifact(router, tmp_path).read_text()))
    assert back.rates == router.rates
    # with its table an aero query goes to web: P(web in the top tier) = P(aero) + P(biomed) / 6 > P(aero);
    # by the first choice it keeps the label
    top, _, _ = linear.decide_timed(back, "supersonic shock", PROVIDERS, {n: 0.0 for n in PROVIDERS}, 0.0)
    first, _, _ = linear.decide_timed(back, "supersonic shock", PROVIDERS, {n: 0.0 for n in PROVIDERS}, 0.0,
                                      top_tier=False)
    assert first[0] == "aero" and top[0] == "web"
    bad = linear.to_artifact(router) | {"top_tier_rates": {"aero": {"web": -1}}}
    with pytest.raises(RatesError, match=r"rates\.aero\.web"):
        linear.from_artifact(bad)


async def test_published_rates_are_pulled_per_version_and_a_version_without_them_decides_by_first_choice(
        tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = PublisherSettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                                 redis=RedisSettings(url="memory://"), storage_dir=tmp_path / "store", public_url=url)

    def adapter(tag: str, rates: bytes | None) -> Path:
        d = tmp_path / tag
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (d / "adapter_model.safetensors").write_bytes(tag.encode() * 64)
        if rates is not None:
            (d / RATES_FILE).write_bytes(rates)
        return d

    table = top_tier_rates(_episodes())
    async with served(create_app(settings), port, what="publisher"):
        def publish() -> list[int]:  # the synchronous client, off the loop that serves the publisher
            with PublisherClient(url) as client:
                return [client.publish("router", adapter(tag, rates), "b", {})["version"] for tag, rates in (
                    ("with", json.dumps(to_json(table, 8)).encode()), ("without", None),
                    ("broken", b'{"format": "fanroute-top-tier-rates"}'))]

        v1, v2, v3 = await asyncio.to_thread(publish)
        published = PublishedRates(url, retry_s=3600)
        try:
            assert await published.get(f"router@{v1}") == table
            assert await published.get(f"router@{v2}") is None
            assert await published.get(f"router@{v3}") is None  # logged; asked again after retry_s
            assert await published.get("not-a-version") is None
        finally:
            await published.close()
