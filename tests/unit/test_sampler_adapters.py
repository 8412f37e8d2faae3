"""The CPU sampler's adapters from outside: announced versions pulled, verified, loaded and aliased; versions
fetched on demand; the adapters topic; the cache after a restart; the real publisher and its client."""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime

import httpx
import pytest

from schemas.adapter import AdapterPublished
from schemas.topics import topic
from services.common.settings import KafkaSettings
from services.sampler.app import create_app
from services.sampler.engine import Engine
from services.sampler.registry import AdapterUnavailable
from services.sampler.serving import Sampler
from tests.support.poll import eventually
from tests.support.sampler_harness import (  # noqa: F401  (fixtures by name)
    BASE, PROMPT, announcement, assert_matches_forward_pass, harness, make_settings, tiny)


async def test_announced_versions_are_pulled_verified_loaded_and_aliased(harness, tiny):
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    reg = harness.sampler.registry
    assert reg.alias_target("router") == "router@1" and reg.is_resident("router@1")
    assert harness.fetched[0][:2] == ("router", 1) and harness.fetched[0][3]  # pulled with the announced hashes
    via_alias = await harness.complete(model="router", max_tokens=4, temperature=0, logprobs=0,
                                       return_token_ids=True, ignore_eos=True)
    assert_matches_forward_pass(tiny, "a", via_alias["choices"][0])
    await harness.sampler.worker.handle(announcement(tiny, 2, "b"))
    assert reg.alias_target("router") == "router@2"
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))  # late replay: the alias stays
    assert reg.alias_target("router") == "router@2" and len(harness.fetched) == 2
    pinned = await harness.complete(model="router@1", max_tokens=4, temperature=0, logprobs=0,
                                    return_token_ids=True, ignore_eos=True)
    assert pinned["choices"][0]["token_ids"] == via_alias["choices"][0]["token_ids"]
    cards = {c["id"]: c for c in (await harness.client.get("/v1/models")).json()["data"]}
    assert {"router", "router@1", "router@2"} <= set(cards) and cards["router"]["root"] == cards["router@2"]["root"]


@pytest.mark.parametrize("harness", [{"publisher_url": "http://publisher"}], indirect=True)
async def test_unknown_version_is_fetched_on_demand_then_answered(harness, tiny):
    body = await harness.complete(model="router@7", max_tokens=4, temperature=0, logprobs=0,
                                  return_token_ids=True, ignore_eos=True)
    assert harness.fetched == [("router", 7, None, None)]  # unannounced: the publisher client checks hashes
    assert_matches_forward_pass(tiny, "a", body["choices"][0])
    missing = await harness.client.post("/v1/completions", json={"model": "router@8", "prompt": "x"})
    assert missing.status_code == 404 and "router@8" in missing.json()["reason"]


@pytest.mark.parametrize("harness", [{"publisher_url": "http://publisher", "down": True}], indirect=True)
async def test_a_version_whose_source_is_down_is_503_not_404(harness):
    """The publisher briefly unreachable is "try again", not "no such model"."""
    r = await harness.client.post("/v1/completions", json={"model": "router@7", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"] == "adapter_source_unreachable", r.json()
    assert "router@7" in r.json()["reason"] and r.json()["type"] == "ServiceUnavailableError"
    assert harness.fetched == [("router", 7, None, None)]


async def test_unknown_model_without_a_source_is_404_with_reason(harness):
    r = await harness.client.post("/v1/completions", json={"model": "router@7", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"] == "model_not_found" and "router@7" in r.json()["reason"]
    assert r.json()["type"] == "NotFoundError" and r.json()["param"] == "model" and harness.fetched == []


@pytest.mark.parametrize("harness", [{"corrupt": True}], indirect=True)
async def test_hash_mismatch_is_refused_and_names_the_file(harness, tiny):
    with pytest.raises(AdapterUnavailable, match="adapter_model.safetensors"):
        await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    reg = harness.sampler.registry
    assert reg.get("router@1") is None and reg.alias_target("router") is None and harness.sampler.eng.slots == []
    assert not harness.sampler.worker.store.dir_for("router", 1).exists()
    assert [p.name for p in harness.sampler.worker.store.dir_for("router", 1).parent.iterdir()] == []
    r = await harness.client.post("/v1/completions", json={"model": "router@1", "prompt": "x"})
    assert r.status_code == 404 and "adapter_model.safetensors" in r.json()["reason"]


@pytest.mark.parametrize("harness", [{"consume_adapters": True}], indirect=True)
async def test_adapters_topic_drives_the_worker(harness, tiny):
    await harness.sampler.bus.publish(topic("adapters"), announcement(tiny, 2, "b"))
    # the in-memory broker delivers on publish; allow a slow handoff anyway
    await eventually(lambda: harness.sampler.registry.alias_target("router") == "router@2", timeout_s=2,
                     interval_s=0.01, what="the worker to serve router@2 from the topic")
    assert harness.sampler.registry.alias_target("router") == "router@2"


async def test_restart_restores_verified_versions_from_the_cache(harness, tiny, tmp_path):
    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    fresh = Sampler(harness.sampler.settings, engine=harness.sampler.eng, fetcher=lambda *a: pytest.fail("pulled"))
    await fresh.start()
    assert fresh.registry.alias_target("router") == "router@1" and not fresh.registry.is_resident("router@1")


async def test_plain_http_fetcher_pulls_the_announced_files(tiny, tmp_path):
    """The fallback fetcher over a real HTTP server: GET <url>/<file> for each announced file, then verify."""
    import functools
    import http.server
    import threading

    from services.sampler.worker import http_file_fetcher

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tiny["a"]))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = make_settings(tmp_path)
        sampler = Sampler(settings, engine=Engine(tiny["base"]), fetcher=http_file_fetcher(5.0))
        await sampler.start()
        msg = announcement(tiny, 3, "a").model_copy(update={"url": f"http://127.0.0.1:{server.server_port}/"})
        await sampler.worker.handle(msg)
        assert sampler.registry.alias_target("router") == "router@3" and sampler.registry.is_resident("router@3")
        assert (sampler.worker.store.dir_for("router", 3) / "adapter_model.safetensors").read_bytes() == \
            (tiny["a"] / "adapter_model.safetensors").read_bytes()
    finally:
        server.shutdown()
        server.server_close()


async def test_verified_but_unusable_download_is_not_kept(harness, tiny):
    """Hashes match, but the files are not a LoRA adapter: refused, deleted, nothing registered."""
    bogus = announcement(tiny, 1, "a").model_copy(update={"files_sha256": {
        "adapter_config.json": hashlib.sha256((tiny["a"] / "adapter_config.json").read_bytes()).hexdigest()}})
    harness.sampler.worker.store.fetcher = lambda m, v, u, f, dest: (
        shutil.copy(tiny["a"] / "adapter_config.json", dest), dest)[1]
    with pytest.raises(AdapterUnavailable, match="not loadable"):
        await harness.sampler.worker.handle(bogus)
    assert harness.sampler.registry.get("router@1") is None
    assert not harness.sampler.worker.store.dir_for("router", 1).exists()


async def test_loading_a_versioned_name_points_its_alias_and_inplace_keeps_it(harness, tiny):
    assert (await harness.load("router@1", tiny["a"])).status_code == 200
    assert harness.sampler.registry.alias_target("router") == "router@1"
    r = await harness.client.post("/v1/load_lora_adapter", json={
        "lora_name": "router@1", "lora_path": str(tiny["b"]), "load_inplace": True})
    assert r.status_code == 200 and harness.sampler.registry.alias_target("router") == "router@1"
    r = await harness.client.post("/v1/unload_lora_adapter", json={"lora_name": "router"})
    assert r.status_code == 200 and harness.sampler.registry.get("router@1") is not None  # alias only


async def test_pulls_through_the_real_publisher_and_its_client(tiny, tmp_path):
    """Publisher app + PublisherClient (in-process HTTP): an announced version, then one on demand."""
    from fastapi.testclient import TestClient

    from services.common.bus import Bus
    from services.common.publisher_client import PublisherClient
    from services.common.settings import RedisSettings
    from services.common.stamps import MemoryStampStore
    from services.publisher.app import Publisher
    from services.publisher.app import create_app as publisher_app
    from services.publisher.settings import PublisherSettings
    from services.sampler.worker import default_fetcher

    url = "http://publisher"
    pset = PublisherSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                             storage_dir=tmp_path / "store", public_url=url)
    publisher = Publisher(pset, Bus(pset.kafka), MemoryStampStore())
    with TestClient(publisher_app(pset, publisher=publisher), base_url=url) as http:
        client = PublisherClient(url, http=http)

        def publish(adapter: str) -> AdapterPublished:
            src = tmp_path / f"publish-{adapter}"
            src.mkdir()
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(tiny[adapter] / name, src / name)
            return AdapterPublished.model_validate(client.publish("router", src, BASE, {}))

        settings = make_settings(tmp_path, publisher_url=url)
        sampler = Sampler(settings, engine=Engine(tiny["base"]),
                          fetcher=default_fetcher(url, 5.0, client=client))
        await sampler.start()
        await sampler.worker.handle(publish("a"))
        assert sampler.registry.alias_target("router") == "router@1"
        v2 = publish("b")  # never handed to the worker: fetched when first asked for
        app = create_app(settings, sampler=sampler)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
            r = await c.post("/v1/completions", json={"model": f"router@{v2.version}", "prompt": PROMPT,
                                                      "max_tokens": 3, "temperature": 0, "logprobs": 0,
                                                      "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert_matches_forward_pass(tiny, "b", r.json()["choices"][0])
        assert sampler.registry.alias_target("router") == "router@2"


async def test_the_sampler_ignores_a_linear_router_announcement() -> None:
    """A linear version on the adapters topic is not a LoRA: the sampler's worker skips it (no pull)."""
    from services.common.adapter_files import LINEAR_ARTIFACT
    from services.sampler.worker import AdapterWorker

    msg = AdapterPublished(model_id="router", version=3, base_model="tfidf+logreg", url="http://pub/router/3",
                           files_sha256={LINEAR_ARTIFACT: "0" * 64}, published_at=datetime.now(UTC))
    worker = AdapterWorker.__new__(AdapterWorker)  # handle() must return before touching anything else
    worker.accept_base_models = ()
    await worker.handle(msg)


async def test_an_announcement_with_other_files_under_a_held_name_is_refused_and_counted(harness, tiny):
    """Two contents under one name (``router@1`` announced again with other files: a Redis that lost the
    publisher's stamp, a reused broker): refused with the files that differ, counted, the first one served."""
    from services.sampler.registry import AdapterConflict

    await harness.sampler.worker.handle(announcement(tiny, 1, "a"))
    with pytest.raises(AdapterConflict, match="adapter_model.safetensors: .* here, .* announced"):
        await harness.sampler.worker.handle(announcement(tiny, 1, "b"))
    metrics = (await harness.client.get("/metrics")).text
    assert 'fanroute_sampler_adapter_events_total{event="conflict"} 1.0' in metrics
    body = await harness.complete(model="router@1", max_tokens=4, temperature=0, logprobs=0, return_token_ids=True,
                                  ignore_eos=True)
    assert_matches_forward_pass(tiny, "a", body["choices"][0])  # still the content it verified first
    assert len(harness.fetched) == 1


async def test_every_answer_names_the_adapter_content_that_gave_it(harness, tiny):
    """The header is the digest of what is loaded under the name (the manifest's digest for a published
    version, through an alias too); the base answers without one."""
    from services.common.adapter_files import ADAPTER_SHA256_HEADER, content_digest, dir_digest

    assert (await harness.load("lora-a", tiny["a"])).status_code == 200
    await harness.sampler.worker.handle(announcement(tiny, 2, "b"))
    named = {}
    for model in ("lora-a", "router", "router@2", BASE):
        r = await harness.client.post("/v1/completions", json={"prompt": PROMPT, "model": model, "max_tokens": 2})
        assert r.status_code == 200, r.text
        named[model] = r.headers.get(ADAPTER_SHA256_HEADER)
    assert named["lora-a"] == dir_digest(tiny["a"])
    assert named["router"] == named["router@2"] == content_digest(announcement(tiny, 2, "b").files_sha256)
    assert named["router@2"] != named["lora-a"] and named[BASE] is None
    chat = await harness.client.post("/v1/chat/completions", json={
        "model": "lora-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.headers[ADAPTER_SHA256_HEADER] == named["lora-a"]
