"""``fanroute loop`` on the real broker and redis-server with the real publisher (kind linear, so a cycle
takes seconds): killed with SIGKILL right after the publisher promoted and before the cycle recorded it,
restarted, it finishes that cycle under the same id and promotes nothing twice; a second slot with no new
episodes is skipped and says so; two replicas on one slot run it once (the Redis lease).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from schemas import AdapterPublished, topic
from schemas.cycle import CycleRecord
from services.common.bus import Bus
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from tests.support.loop_market import ROOT, loop_process, market_episodes, market_trace, split_queries
from tests.support.serving import free_port, served

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]


async def _seed(kafka: KafkaSettings) -> datetime:
    """Training episodes and the evaluated queries' fan-out traces on the topics; returns a slot after them."""
    trained, evaluated = split_queries()
    bus = Bus(kafka, client_id="loop-test")
    await bus.start((topic("episodes"), topic("traces")))
    try:
        for ep in market_episodes(trained):
            await bus.publish(topic("episodes"), ep)
        for q in evaluated:
            await bus.publish(topic("traces"), market_trace(q))
    finally:
        await bus.stop()
    return (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0)


def _env(kafka: KafkaSettings, redis_url: str, publisher_url: str, tmp_path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "FANROUTE_KAFKA__TOPIC_NAMESPACE": kafka.topic_namespace, "FANROUTE_REDIS__URL": redis_url,
            "FANROUTE_PUBLISHER_URL": publisher_url, "FANROUTE_KIND": "linear", "FANROUTE_MODEL_ID": "router",
            "FANROUTE_MIN_NEW_EPISODES": "10", "FANROUTE_HELD_OUT_FRACTION": "0.01", "FANROUTE_BOOTSTRAP": "200",
            "FANROUTE_LEASE_TTL_S": "5", "FANROUTE_WORK_DIR": str(tmp_path / "loop"), **extra}


async def _run(env: dict[str, str], *argv: str, hold: str | None = None) -> tuple[int | None, str]:
    """Run the loop; with ``hold``, SIGKILL it as soon as it says it holds there. Returns (status, output)."""
    proc = loop_process(env, *argv)

    def read() -> str:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if hold is not None and line.strip() == f"holding after {hold}":
                os.kill(proc.pid, signal.SIGKILL)
        return "".join(seen)

    out = await asyncio.to_thread(read)
    code = await asyncio.to_thread(proc.wait, 600)
    return code, out


async def _ask(url: str, method: str, *args: str):
    """A publisher client call off the event loop (the publisher is served on it)."""
    def call():
        with PublisherClient(url) as client:
            return getattr(client, method)(*args)

    return await asyncio.to_thread(call)


async def _cycles(kafka: KafkaSettings) -> list[CycleRecord]:
    return [r async for r in read_topic(kafka, topic("cycles"), model=CycleRecord)]


async def _promotions(kafka: KafkaSettings) -> list[AdapterPublished]:
    return [a async for a in read_topic(kafka, topic("adapters"), model=AdapterPublished) if a.promoted]


async def test_killed_after_promoting_resumes_the_cycle_and_promotes_once(kafka_bootstrap, redis_url, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"loop{uuid.uuid4().hex[:8]}.")
    slot = await _seed(kafka)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pub = PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url), port=port,
                            storage_dir=tmp_path / "store", public_url=url)
    async with served(publisher_app(pub), port, what="publisher"):
        env = _env(kafka, redis_url, url, tmp_path)
        code, out = await _run({**env, "FANROUTE_HOLD_AFTER": "promote_sent"}, "--once", "--slot", slot.isoformat(),
                               hold="promote_sent")
        assert code == -signal.SIGKILL, out
        assert (await _ask(url, "promoted", "router"))["version"] == 1  # the publisher promoted before the kill
        before = await _cycles(kafka)
        assert [r.phase for r in before] == ["started", "trained", "evaluated"], out
        assert before[2].decision == "promote" and before[2].figures["candidate/human"] > before[2].figures[
            "best_single/human"], before[2]

        code, out = await _run(env, "--once", "--slot", slot.isoformat())
        assert code == 0, out
        records = await _cycles(kafka)
        assert [r.phase for r in records] == ["started", "trained", "evaluated", "promoted", "finished"], out
        assert len({r.cycle_id for r in records}) == 1 and len({r.record_id for r in records}) == 5
        assert records[-1].adapter_out == "router@1" and records[-1].adapter_in is None
        promotions = await _promotions(kafka)
        assert [(a.model_id, a.version) for a in promotions] == [("router", 1)]  # promoted once, not twice
        assert [v["version"] for v in await _ask(url, "versions", "router")] == [1]  # trained once, not twice

        # The next slot finds no episode appended since the last cycle: skipped, with the reason.
        code, out = await _run(env, "--once", "--slot", (slot + timedelta(days=1)).isoformat())
        assert code == 0, out
        last = (await _cycles(kafka))[-1]
        assert last.phase == "skipped" and "0 new episodes" in last.reason and last.adapter_in == "router@1"
        assert "skipped" in out


async def test_two_replicas_on_one_slot_run_one_cycle(kafka_bootstrap, redis_url, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"loop2{uuid.uuid4().hex[:8]}.")
    slot = await _seed(kafka)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pub = PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url), port=port,
                            storage_dir=tmp_path / "store", public_url=url)
    async with served(publisher_app(pub), port, what="publisher"):
        env = _env(kafka, redis_url, url, tmp_path)
        (a, out_a), (b, out_b) = await asyncio.gather(_run(env, "--once", "--slot", slot.isoformat()),
                                                      _run(env, "--once", "--slot", slot.isoformat()))
        assert (a, b) == (0, 0), out_a + out_b
        records = await _cycles(kafka)
        assert [r.phase for r in records] == ["started", "trained", "evaluated", "promoted", "finished"]
        assert [v["version"] for v in await _ask(url, "versions", "router")] == [1]
        assert [(p.model_id, p.version) for p in await _promotions(kafka)] == [("router", 1)]
