"""A publisher outage on the real broker: the sampler's adapter announcement waits it out, nothing is
dead-lettered; a publisher that refuses (404) is still dead-lettered with its reason.

The real AdapterWorker, AdapterStore and PublisherClient fetcher pull from a real HTTP server (aiohttp
on a free port) that stands in for the publisher; it is stopped for longer than the old retry budget
(three tries in about 0.6 s), then started again on the same port.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from datetime import UTC, datetime

import pytest
from aiohttp import web

from schemas import AdapterPublished, topic
from services.common.bus import Bus, dead_letter_from_record
from services.common.replay_topic import read_records_to_end
from services.common.settings import KafkaSettings
from services.sampler.registry import AdapterEntry, AdapterRegistry
from services.sampler.worker import (
    AdapterStore,
    AdapterWorker,
    default_fetcher,
    is_unreachable,
)
from tests.support.poll import eventually
from tests.support.serving import free_port

pytestmark = pytest.mark.kafka
OUTAGE_S = 2.5  # well past the old 0.6 s budget
FILES = {"adapter_config.json": b'{"r": 4, "peft_type": "LORA"}', "adapter_model.safetensors": b"weights" * 100}
SHA = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}


class StandInPublisher:
    """The publisher's manifest and blob routes for one version, on a port it can leave and come back to."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.requests = 0
        self._runner: web.AppRunner | None = None

    async def _manifest(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.json_response({"files_sha256": SHA,
                                  "file_urls": {n: f"{self.base}/blobs/{n}" for n in FILES}})

    async def _blob(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.Response(body=FILES[request.match_info["name"]])

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/adapters/router/versions/1", self._manifest)
        app.router.add_get("/blobs/{name}", self._blob)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class FakeSampler:
    """The sampler as the worker sees it, without a model: a registry and a register that keeps the entry."""

    def __init__(self) -> None:
        self.registry = AdapterRegistry(4)

    async def register(self, entry: AdapterEntry) -> None:
        self.registry.add(entry)


def _announcement(version: int, url: str) -> AdapterPublished:
    return AdapterPublished(model_id="router", version=version, base_model="tiny-base", url=url,
                            files_sha256=SHA, published_at=datetime.now(UTC))


async def test_publisher_outage_is_waited_out_and_nothing_is_dead_lettered(kafka_bootstrap, tmp_path):
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"tr{uuid.uuid4().hex[:10]}.",
                             transient_backoff_initial_s=0.1, transient_backoff_max_s=0.5, transient_budget_s=60)
    publisher = StandInPublisher(free_port())
    fetch = default_fetcher(publisher.base, 2.0)
    failures: list[BaseException] = []

    def counting_fetcher(*args):
        try:
            return fetch(*args)
        except Exception as exc:
            failures.append(exc)
            raise

    sampler = FakeSampler()
    worker = AdapterWorker(sampler, AdapterStore(tmp_path / "cache", counting_fetcher), publisher_url=publisher.base)
    bus = Bus(settings)
    bus.subscribe(topic("adapters"), worker.handle, group_id="sampler-outage")
    await bus.start((topic("adapters"),))
    await publisher.start()
    try:
        await publisher.stop()  # the outage starts
        down_at = time.monotonic()
        await bus.publish(topic("adapters"),
                          _announcement(1, f"{publisher.base}/v1/adapters/router/versions/1"))
        await eventually(lambda: len(failures) >= 3 and time.monotonic() - down_at >= OUTAGE_S, timeout_s=30,
                         what=f"three failed pulls and {OUTAGE_S} s of outage", interval_s=0.05)
        assert sampler.registry.get("router@1") is None
        await publisher.start()
        outage_s = time.monotonic() - down_at
        await eventually(lambda: sampler.registry.get("router@1") is not None, timeout_s=30,
                         what="the announcement to be pulled after the outage", interval_s=0.05)
        assert sampler.registry.alias_target("router") == "router@1"
        assert publisher.requests == 1 + len(FILES)  # the manifest and each blob, once, after the outage
        assert outage_s > OUTAGE_S and all(is_unreachable(e) for e in failures), failures
        dead = [r async for r in read_records_to_end(settings, bus.dlq_name(topic("adapters")))]
        assert dead == []

        # A refusal is not an outage: the publisher answers 404, the announcement is dead-lettered.
        await bus.publish(topic("adapters"), _announcement(2, f"{publisher.base}/v1/adapters/router/versions/2"))
        async def dead_letters() -> list:
            return [r async for r in read_records_to_end(settings, bus.dlq_name(topic("adapters")))]

        dead = await eventually(dead_letters, timeout_s=30, what="the refused announcement dead-lettered")
        [letter] = [dead_letter_from_record(r) for r in dead]
        assert "HTTP 404" in letter.reason and letter.error_type == "AdapterUnavailable"
        assert AdapterPublished.model_validate_json(letter.original).version == 2
    finally:
        await bus.stop()
        await publisher.stop()
