"""``fanroute loop`` on the real broker and redis-server with the real publisher (kind linear, so a cycle
takes seconds): killed with SIGKILL right after the publisher promoted and before the cycle recorded it,
restarted, it finishes that cycle under the same id and promotes nothing twice; a second slot with no new
episodes is skipped and says so; two replicas on one slot run it once (the Redis lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from schemas import AdapterPublished, topic
from schemas.cycle import CycleRecord
from services.common.bus import Bus
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings, RedisSettings
from services.loop.lease import lease_key
from services.publisher.app import create_app as publisher_app
from services.publisher.settings import PublisherSettings
from tests.support.loop_market import ROOT, loop_process, market_episodes, market_trace, split_queries
from tests.support.poll import eventually
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


@contextlib.asynccontextmanager
async def _loop_stack(kafka_bootstrap: str, redis_url: str, tmp_path, prefix: str):
    """Fresh topics seeded with the market, a real publisher; yields (kafka, a slot after the seed, its URL, the
    loop's environment)."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"{prefix}{uuid.uuid4().hex[:8]}.")
    slot = await _seed(kafka)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pub = PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url), port=port,
                            storage_dir=tmp_path / "store", public_url=url)
    async with served(publisher_app(pub), port, what="publisher"):
        yield kafka, slot, url, _env(kafka, redis_url, url, tmp_path)


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
    async with _loop_stack(kafka_bootstrap, redis_url, tmp_path, "loop") as (kafka, slot, url, env):
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
    async with _loop_stack(kafka_bootstrap, redis_url, tmp_path, "loop2") as (kafka, slot, url, env):
        (a, out_a), (b, out_b) = await asyncio.gather(_run(env, "--once", "--slot", slot.isoformat()),
                                                      _run(env, "--once", "--slot", slot.isoformat()))
        assert (a, b) == (0, 0), out_a + out_b
        records = await _cycles(kafka)
        assert [r.phase for r in records] == ["started", "trained", "evaluated", "promoted", "finished"]
        assert [v["version"] for v in await _ask(url, "versions", "router")] == [1]
        assert [(p.model_id, p.version) for p in await _promotions(kafka)] == [("router", 1)]


async def test_every_runs_a_cycle_per_slot_and_skips_slots_without_new_episodes(kafka_bootstrap, redis_url, tmp_path):
    async with _loop_stack(kafka_bootstrap, redis_url, tmp_path, "loop3") as (kafka, slot, url, env):
        # The first slot the loop runs must come after the seed: wait for the clock (a timer, not a sync wait),
        # else a slot that began mid-seed trains on part of the data.
        await asyncio.sleep(max(0.0, (slot + timedelta(seconds=2) - datetime.now(UTC)).total_seconds()))
        proc = loop_process(env, "--every", "2s")

        def until_a_skip() -> list[str]:
            """Lines until a cycle finished and a later slot was skipped (no episode appended since)."""
            assert proc.stdout is not None
            lines, finished = [], False
            for line in proc.stdout:  # one line per cycle as it ends
                lines.append(line)
                finished = finished or ": finished;" in line
                if finished and ": skipped;" in line:
                    proc.send_signal(signal.SIGTERM)  # a clean stop: the lease is given back, exit 0
                    lines += list(proc.stdout)
                    break
            return lines

        try:
            lines = await asyncio.wait_for(asyncio.to_thread(until_a_skip), timeout=300)
            assert await asyncio.to_thread(proc.wait, 60) == 0, "".join(lines)
        finally:
            proc.kill()
            proc.wait(30)
        assert lines[-1].startswith("stopped"), "".join(lines)
        lease = aioredis.Redis.from_url(redis_url)
        try:
            assert await lease.get(lease_key(kafka.topic_namespace, "router", "linear")) is None
        finally:
            await lease.aclose()
        records = await _cycles(kafka)
        ended = [r for r in records if r.phase in ("finished", "skipped")]
        first = next(i for i, r in enumerate(ended) if r.phase == "finished")
        assert ended[first + 1].phase == "skipped", "".join(lines)
        assert ended[first].trigger == "schedule" and ended[first + 1].slot > ended[first].slot
        assert all(r.slot.timestamp() % 2 == 0 for r in ended)  # slots aligned to the interval
        # One promotion: the finished cycle's candidate, trained once.
        promoted = [f"{p.model_id}@{p.version}" for p in await _promotions(kafka)]
        assert promoted == [ended[first].adapter_out] == ["router@1"], "".join(lines)
        assert all(r.phase != "promoted" or r.cycle_id == ended[first].cycle_id for r in records)


async def test_an_lm_cycle_continues_the_deployed_adapter_and_is_asked_through_the_sampler(
        kafka_bootstrap, redis_url, tmp_path, monkeypatch):
    """kind lm on a tiny model: the deployed adapter is pulled and trained on (the trainer's own log says it
    started from it), the new version is published by the trainer, and the evaluation asks it through the
    real CPU sampler — the cycle's records carry adapter in and out, the decision and the timings."""
    from services.loop.settings import LoopSettings
    from services.loop.worker import Loop
    from services.sampler.app import create_app as sampler_app
    from services.sampler.settings import SamplerSettings
    from tests.support.tiny_model import build_lora_adapter, build_tiny_model

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"loop4{uuid.uuid4().hex[:8]}.")
    redis = RedisSettings(url=redis_url)
    slot = await _seed(kafka)
    base = build_tiny_model(tmp_path / "base")
    deployed = build_lora_adapter(base, tmp_path / "v1", seed=1)
    monkeypatch.setenv("FANROUTE_BASE_MODEL", str(base))  # the trainer's process reads it
    pport, sport = free_port(), free_port()
    purl = f"http://127.0.0.1:{pport}"
    pub = PublisherSettings(kafka=kafka, redis=redis, port=pport, storage_dir=tmp_path / "store", public_url=purl)
    samp = SamplerSettings(kafka=kafka, redis=redis, port=sport, base_model=str(base), publisher_url=purl,
                           adapter_cache_dir=tmp_path / "cache", group_id=f"sampler-{kafka.topic_namespace}")
    async with served(publisher_app(pub), pport, what="publisher", start_timeout_s=120), \
            served(sampler_app(samp), sport, what="sampler", start_timeout_s=120) as surl:
        def deploy_v1() -> None:
            with PublisherClient(purl) as client:
                client.publish("router", deployed, str(base), {})
                client.promote("router", 1, fallback_provider="web")

        await asyncio.to_thread(deploy_v1)
        settings = LoopSettings(kafka=kafka, redis=redis, publisher_url=purl, router_url=surl, kind="lm", once=True,
                                model_id="router", min_new_episodes=10, held_out_fraction=0.01, max_steps=2,
                                batch_size=4, allow_uncalibrated=True, router_mode="score", router_timeout_s=60,
                                bootstrap=100, max_router_p99_ms=None, work_dir=tmp_path / "loop")
        loop = Loop(settings)
        await loop.start()
        try:
            record = await loop.once(slot)
        finally:
            await loop.stop()
    assert record is not None and record.phase == "finished", record
    assert (record.adapter_in, record.adapter_out) == ("router@1", "router@2")
    assert record.decision in ("promote", "refuse") and record.figures["held_out"] == len(split_queries()[1])
    assert {"dataset", "train", "eval"} <= set(record.timings_s)
    trainer_log = (tmp_path / "loop" / record.cycle_id / "train" / "run" / "trainer.log").read_text()
    first = trainer_log.splitlines()[0]  # the command line: started from the deployed version it pulled
    assert "--init-adapter" in first and str(tmp_path / "loop" / record.cycle_id / "deployed") in first


async def test_drift_on_the_slice_calls_a_cycle_early(kafka_bootstrap, redis_url, tmp_path):
    """After a cycle, the slice's verdicts say ``alpha`` got worse: the scheduled loop (next slot an hour
    away) runs a cycle early with trigger ``drift`` and records the drift that called it."""
    from schemas.verdict import CandidateGrade, Verdict

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"loop5{uuid.uuid4().hex[:8]}.")
    trained, evaluated = split_queries()

    def verdicts(tag: str, alpha: int) -> list[Verdict]:
        now = datetime.now(UTC)
        return [Verdict(verdict_id=f"{tag}-{i}", trace_id=f"{tag}-{i}", judged_at=now, judge_kind="local",
                        judge_model="m", rubric_version="r", rubric_hash="h", status="ok", sampled_because="sampled",
                        letters={"A": "alpha", "B": "beta", "C": "web"},
                        grades=(CandidateGrade(provider="alpha", letter="A", grade=alpha),
                                CandidateGrade(provider="beta", letter="B", grade=2),
                                CandidateGrade(provider="web", letter="C", grade=2)),
                        ordering=(("alpha",), ("beta", "web")) if alpha == 3 else (("beta", "web"), ("alpha",)))
                for i in range(25)]

    async def publish(name: str, records) -> None:
        bus = Bus(kafka, client_id="loop-test")
        await bus.start((topic(name),))
        try:
            for r in records:
                await bus.publish(topic(name), r)
        finally:
            await bus.stop()

    await publish("verdicts", verdicts("before", 3))
    slot = await _seed(kafka)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pub = PublisherSettings(kafka=kafka, redis=RedisSettings(url=redis_url), port=port,
                            storage_dir=tmp_path / "store", public_url=url)
    async with served(publisher_app(pub), port, what="publisher"):
        env = _env(kafka, redis_url, url, tmp_path)
        code, out = await _run(env, "--once", "--slot", slot.isoformat())
        assert code == 0, out
        await eventually(lambda: datetime.now(UTC) > slot + timedelta(milliseconds=5), timeout_s=5,
                         what="the clock to pass the first slot", interval_s=0.01)
        await publish("verdicts", verdicts("after", 0))  # alpha now answers nothing useful
        await publish("episodes", [e for e in market_episodes(trained, copies=5)  # new labels: copies 3 and 4
                                   if e.episode_id.endswith(("-3", "-4"))])
        await publish("traces", [market_trace(q, trace_id=f"again-{q}") for q in evaluated])
        proc = loop_process({**env, "FANROUTE_DRIFT_CHECK_S": "1"}, "--every", "1h")

        def until_drift() -> list[str]:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "(drift):" in line:
                    proc.kill()
                    break
            return lines

        try:
            lines = await asyncio.wait_for(asyncio.to_thread(until_drift), timeout=300)
        finally:
            proc.kill()
            proc.wait(30)
    early = [r for r in await _cycles(kafka) if r.trigger == "drift"]
    assert early, "".join(lines)
    drift = early[0].drift
    assert drift is not None and drift.triggered and drift.worst == "alpha", drift
    assert drift.score == pytest.approx(1.0) and early[0].phase == "started"
