"""A send the real broker wrote but the producer reported failed: spooled, and not written a second time.

The duplicate seen once in CI (docs/faults.md, the Kafka-paused row): after a pause the outbox's sends
failed with OutOfOrderSequenceNumber, the producer was replaced, and one record the broker had in fact
written was re-published by the new producer. Before a re-publish the outbox now reads the topic since
the record's first send for its trace id (:class:`services.common.replay_topic.KeyWatch`).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import httpx
import pytest

from bench.gateway_outage import InstantProvider
from schemas import Trace, topic
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.replay_topic import KeyWatch, read_topic
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.config import BM25Config
from tests.support import fault_matrix
from tests.support.poll import eventually
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]


class LostAnswerBus(Bus):
    """The real producer; while ``lose_answers``, each send is written and then reported failed."""

    lose_answers = False

    async def publish_raw(self, topic, value, *, key, headers, timeout_s="setting") -> None:
        await super().publish_raw(topic, value, key=key, headers=headers, timeout_s=timeout_s)
        if self.lose_answers:
            raise BusError(f"publish to {topic} failed: KafkaTimeoutError (written, the answer lost)")


@pytest.mark.parametrize("check", [True, False], ids=["topic checked", "not checked"])
async def test_a_written_send_reported_failed_is_on_the_topic_once(kafka_bootstrap, tmp_path, request, check):
    ns = f"written{uuid.uuid4().hex[:8]}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns,
                          transient_backoff_initial_s=0.1, transient_backoff_max_s=0.5)
    settings = GatewaySettings(kafka=kafka, port=free_port(), spool_dir=tmp_path / "spool", publish_wait_s=2.0,
                               spool_check_topic=check, providers=[BM25Config(name="unused")], log_level="WARNING")
    bus = LostAnswerBus(kafka, client_id="gw-written")
    gw = build_gateway(settings, bus=bus, providers=[InstantProvider("alpha"), InstantProvider("beta")])
    answered: dict[str, str] = {}
    async with served(create_app(settings, gateway=gw), settings.port, what="gateway", start_timeout_s=60) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        bus.lose_answers = True
        for i in range(5):
            r = await client.post("/v1/search", json={"query": f"written {i}", "request_id": f"{ns}{i}"})
            assert r.status_code == 200 and r.json()["trace_status"] == "spooled", r.text
            answered[r.json()["trace_id"]] = "spooled"
        bus.lose_answers = False
        r = await client.post("/v1/search", json={"query": "after", "request_id": f"{ns}after"})
        assert r.json()["trace_status"] == "published", r.text
        answered[r.json()["trace_id"]] = "published"

        async def drained() -> bool:
            return (await client.get("/healthz")).json()["spool"]["depth"] == 0

        await eventually(drained, timeout_s=60, what="the spool emptied")
        ids = [t.trace_id async for t in read_topic(kafka, topic("traces"), model=Trace)]
    found = gw.metrics.registry.get_sample_value("fanroute_traces_spool_found_on_topic_total")
    copies = Counter(ids)
    assert set(copies) == set(answered)  # 0 lost either way
    if not check:  # the control: the test can fail, a re-publish writes a second copy
        assert max(copies.values()) >= 2, copies
        return
    row = fault_matrix.exactly_once(
        "sends written by the broker but reported failed (the answer lost), then re-published",
        "gateway (trace outbox)", fault_matrix.test_id(request), records_in=len(answered), expected=answered,
        results=ids, spooled=5, found_on_topic=found)
    assert row.lost == 0 and row.duplicates == 0 and found == 5  # found on the topic, none sent twice


async def test_a_key_watch_reads_from_its_time_and_goes_on_from_where_it_stopped(kafka_bootstrap):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"watch{uuid.uuid4().hex[:8]}.")
    bus = Bus(kafka, client_id="watch")
    await bus.start((topic("traces"),))
    try:
        name = bus.name(topic("traces"))
        await bus.publish_raw(name, b"{}", key=b"before", headers={}, timeout_s=10)
        since_ms = int(time.time() * 1000) + 1
        while int(time.time() * 1000) < since_ms + 5:  # the next record's timestamp is past since_ms
            time.sleep(0.001)
        await bus.publish_raw(name, b"{}", key=b"first", headers={}, timeout_s=10)
        watch = KeyWatch(kafka, name, since_ms)
        assert await watch.refresh() == {b"first"}  # the record before since_ms is not read
        first_positions = dict(watch.positions)
        await bus.publish_raw(name, b"{}", key=b"second", headers={}, timeout_s=10)
        assert await watch.refresh() == {b"first", b"second"}
        assert sum(watch.positions.values()) == sum(first_positions.values()) + 1  # read on, not again
        assert await KeyWatch(kafka, bus.name(topic("episodes")), since_ms).refresh() == set()  # no such topic
    finally:
        await bus.stop()
