"""Fault matrix, rollout runner row: the runner (its own process, real broker, redis-server, bubblewrap, the
real relay) killed with SIGKILL while its groups' harnesses are still running, then restarted: every task it
had accepted (offset committed) comes back as exactly one group, from the ledger the killed run left in Redis.

A runner's result for a task record is one published group; counted by task id (each test task is distinct).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from schemas import topic
from schemas.rollout import RolloutGroup
from services.common.bus import publish_once
from services.common.settings import KafkaSettings, RedisSettings
from services.episodes.tasks import build_task
from tests.support.fault_matrix import exactly_once, test_id
from tests.support.poll import eventually
from tests.support.processes import running, service_env
from tests.support.records import NOW, judged_trace, verdict_for
from tests.support.relay import relay_served, relay_settings
from tests.support.tiny_model import build_tiny_model
from tests.support.topics import topic_records, wait_for_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]
ADMIN = "fault-rollouts-admin"


def harness(root: Path, name: str, script: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "h.sh").write_text(script)
    return d


def runner_env(kafka: KafkaSettings, redis_url: str, relay_url: str, group_id: str, work: Path,
               harness_dir: Path) -> dict[str, str]:
    """A runner of groups of 2 with the scripted harness in ``harness_dir``, against the test's relay."""
    return service_env(kafka, redis_url, FANROUTE_RELAY_URL=relay_url, FANROUTE_ADMIN_TOKEN=ADMIN,
                       FANROUTE_GROUP_ID=group_id, FANROUTE_GROUP_SIZE="2", FANROUTE_MAX_PARALLEL="6",
                       FANROUTE_WORK_DIR=str(work), FANROUTE_HARNESS__NAME="scripted",
                       FANROUTE_HARNESS__DIRECTORY=str(harness_dir),
                       FANROUTE_HARNESS__COMMAND=json.dumps(["bash", "/harness/h.sh"]),
                       FANROUTE_SANDBOX_TIMEOUT_S="900", FANROUTE_COMMAND_TIMEOUT_S="900")


async def test_a_runner_killed_mid_group_loses_no_group(kafka_bootstrap, redis_url, tmp_path, request):
    ns = f"fr{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    base = build_tiny_model(tmp_path / "base")
    stuck = harness(tmp_path, "stuck", "sleep 600\n")  # the kill lands while every group is mid-rollout
    quick = harness(tmp_path, "quick", 'echo "bm25-all = eng-bm25 > dense-all > lib-bm25" > /app/answer.txt\n')
    tasks = [build_task(judged_trace(f"t-{i}"), verdict_for(f"t-{i}"), now=NOW) for i in range(3)]
    group_id = f"rollouts-{ns}".rstrip(".").lower()
    ledger_key = f"{ns}rollouts:ledger:{group_id}:pending"
    client = aioredis.Redis.from_url(redis_url)
    work = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))  # AF_UNIX paths stop at 107 bytes: keep it short
    relay = relay_settings(base, kafka=kafka, redis=redis, sampler_url="http://127.0.0.1:9", admin_token=ADMIN,
                           adapter_model_id="router")
    try:
        async with relay_served(relay) as (url, _):
            def env(harness_dir: Path) -> dict[str, str]:
                return runner_env(kafka, redis_url, url, group_id, work, harness_dir)

            with running("-m", "services.rollouts", env=env(stuck), crash=True):
                for t in tasks:
                    await publish_once(kafka, topic("tasks"), t, client_id="test")
                await eventually(lambda: _ledger_size(client, ledger_key, 3), timeout_s=120,
                                 what="the runner accepting all three tasks (its ledger)")
            before = await topic_records(kafka, "rollouts", RolloutGroup)
            with running("-m", "services.rollouts", env=env(quick)), contextlib.suppress(AssertionError):
                # a timeout here is reported below, as lost groups in the row
                await wait_for_records(kafka, "rollouts", RolloutGroup, 3, timeout_s=180,
                                       what="the three groups after the restart")
                await eventually(lambda: _ledger_size(client, ledger_key, 0), timeout_s=60,
                                 what="the ledger emptied once the groups are out")
            groups = await topic_records(kafka, "rollouts", RolloutGroup)
    finally:
        await client.aclose()
        shutil.rmtree(work, ignore_errors=True)
    exactly_once("kill -9 mid-group, restart", "rollout runner", test_id(request), records_in=len(tasks),
                 expected={t.task_id for t in tasks}, results=[g.task_id for g in groups],
                 groups_before_kill=len(before))
    assert before == []  # the kill landed before any group was out
    assert all(r.outcome == "completed" and r.reward == 1.0 for g in groups for r in g.rollouts)


async def _ledger_size(client: aioredis.Redis, key: str, want: int) -> bool:
    return await client.hlen(key) == want


async def test_a_runner_killed_between_publishing_a_group_and_marking_it_done(kafka_bootstrap, tmp_path, request):
    """The window the ledger cannot close: the group is on the topic, its ledger entry is not yet marked done
    (the runner's Redis is stopped right then), the runner is killed. On restart it runs the record again; the
    second group carries the first one's id (derived from the record), so the trainer's feeder drops it,
    counted: the row's consumer is the trainer, which sees one group per task."""
    from datetime import UTC, datetime, timedelta

    from services.trainer.rl_data import Feeder
    from tests.support.redis_server import RedisServer

    ns = f"fw{uuid.uuid4().hex[:8]}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns)
    base = build_tiny_model(tmp_path / "base")
    gated = harness(tmp_path, "gated", 'while [ ! -e /harness/open ]; do sleep 0.1; done\n'
                                       'echo "bm25-all = eng-bm25 > dense-all > lib-bm25" > /app/answer.txt\n')
    task = build_task(judged_trace("t-window"), verdict_for("t-window"), now=NOW)
    sent_at = datetime.now(UTC) - timedelta(minutes=5)
    group_id = f"rollouts-{ns}".rstrip(".").lower()
    work = Path(tempfile.mkdtemp(prefix="fw-", dir="/tmp"))
    # the relay keeps its credentials in memory: only the runner's ledger loses its Redis
    relay = relay_settings(base, kafka=kafka, sampler_url="http://127.0.0.1:9", admin_token=ADMIN,
                           adapter_model_id="router")
    try:
        with RedisServer(tmp_path / "redis") as redis_server:
            ledger_key = f"{ns}rollouts:ledger:{group_id}:pending"
            client = aioredis.Redis.from_url(redis_server.url)
            async with relay_served(relay) as (url, _):
                env = service_env(kafka, redis_server.url, FANROUTE_RELAY_URL=url, FANROUTE_ADMIN_TOKEN=ADMIN,
                                  FANROUTE_GROUP_ID=group_id, FANROUTE_GROUP_SIZE="2", FANROUTE_WORK_DIR=str(work),
                                  FANROUTE_HARNESS__NAME="scripted", FANROUTE_HARNESS__DIRECTORY=str(gated),
                                  FANROUTE_HARNESS__COMMAND=json.dumps(["bash", "/harness/h.sh"]),
                                  FANROUTE_SANDBOX_TIMEOUT_S="300", FANROUTE_COMMAND_TIMEOUT_S="300")
                with running("-m", "services.rollouts", env=env, crash=True):
                    await publish_once(kafka, topic("tasks"), task, client_id="test")
                    await eventually(lambda: _ledger_size(client, ledger_key, 1), timeout_s=120,
                                     what="the runner accepting the task (its ledger)")
                    await client.aclose()
                    redis_server.stop()  # clean stop: the accepted entry is in the append-only file
                    (gated / "open").touch()  # the group finishes, is published, and cannot be marked done
                    await wait_for_records(kafka, "rollouts", RolloutGroup, 1, timeout_s=180,
                                           what="the group published while the ledger's Redis is down")
                first = await topic_records(kafka, "rollouts", RolloutGroup)
                redis_server.start()  # back, with the entry still pending
                client = aioredis.Redis.from_url(redis_server.url)
                assert await client.hlen(ledger_key) == 1
                with running("-m", "services.rollouts", env=env):
                    await wait_for_records(kafka, "rollouts", RolloutGroup, 2, timeout_s=180,
                                           what="the record run again after the restart")
                    await eventually(lambda: _ledger_size(client, ledger_key, 0), timeout_s=60,
                                     what="the ledger emptied once the second group is out")
                groups = await topic_records(kafka, "rollouts", RolloutGroup)
                await client.aclose()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    feeder = Feeder("router", [task])
    feeder.sent(task, at=sent_at)
    kinds = [feeder.claim(g) for g in groups]
    accepted = [g.task_id for g, kind in zip(groups, kinds, strict=True) if kind == "train"]
    exactly_once("kill -9 between publishing a group and marking it done (the runner's Redis stopped in "
                 "that window), restart", "rollout runner → trainer feeder", test_id(request), records_in=1,
                 expected={task.task_id}, results=accepted, groups_on_topic=len(groups),
                 dropped_duplicates=kinds.count("duplicate"))
    assert len(first) == 1 and len(groups) == 2 and len({g.group_id for g in groups}) == 1  # the window was hit
    assert kinds == ["train", "duplicate"]


async def test_a_flushed_ledger_then_a_killed_runner_loses_no_group(kafka_bootstrap, tmp_path, request):
    """Redis FLUSHALL while three accepted groups run (offsets committed), then kill -9, then a restart. The
    ledger's pending entries are rebuilt from the topics (services/rollouts/ledger_rebuild.py); before that,
    the restart found an empty ledger and all three groups were lost."""
    from tests.support.redis_server import RedisServer
    from tests.support.topics import group_caught_up

    ns = f"fl{uuid.uuid4().hex[:8]}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns)
    base = build_tiny_model(tmp_path / "base")
    stuck = harness(tmp_path, "stuck", "sleep 600\n")
    quick = harness(tmp_path, "quick", 'echo "bm25-all = eng-bm25 > dense-all > lib-bm25" > /app/answer.txt\n')
    tasks = [build_task(judged_trace(f"t-{i}"), verdict_for(f"t-{i}"), now=NOW) for i in range(3)]
    group_id = f"rollouts-{ns}".rstrip(".").lower()
    ledger_key = f"{ns}rollouts:ledger:{group_id}:pending"
    work = Path(tempfile.mkdtemp(prefix="fl-", dir="/tmp"))
    with RedisServer(tmp_path / "redis") as server:
        redis = RedisSettings(url=server.url)
        client = aioredis.Redis.from_url(server.url)
        relay = relay_settings(base, kafka=kafka, redis=redis, sampler_url="http://127.0.0.1:9", admin_token=ADMIN,
                               adapter_model_id="router")
        try:
            async with relay_served(relay) as (url, _):
                def env(harness_dir: Path) -> dict[str, str]:
                    return runner_env(kafka, server.url, url, group_id, work, harness_dir)

                with running("-m", "services.rollouts", env=env(stuck), crash=True):
                    for t in tasks:
                        await publish_once(kafka, topic("tasks"), t, client_id="test")
                    await eventually(lambda: _ledger_size(client, ledger_key, 3), timeout_s=120,
                                     what="the runner accepting all three tasks (its ledger)")
                    await eventually(lambda: group_caught_up(kafka, f"{group_id}.tasks", "tasks"), timeout_s=60,
                                     what="the three task offsets committed (no redelivery can save them)")
                    flushed = await client.dbsize()
                    await client.flushall()
                with running("-m", "services.rollouts", env=env(quick)), contextlib.suppress(AssertionError):
                    await wait_for_records(kafka, "rollouts", RolloutGroup, 3, timeout_s=180,
                                           what="the three groups after the restart")
                    await eventually(lambda: _ledger_size(client, ledger_key, 0), timeout_s=60,
                                     what="the ledger emptied once the groups are out")
                groups = await topic_records(kafka, "rollouts", RolloutGroup)
        finally:
            await client.aclose()
            shutil.rmtree(work, ignore_errors=True)
    exactly_once("Redis FLUSHALL under running groups (offsets committed), then kill -9, restart", "rollout runner",
                 test_id(request), records_in=len(tasks), expected={t.task_id for t in tasks},
                 results=[g.task_id for g in groups], redis_keys_flushed=flushed)
    assert flushed >= 2  # the ledger's entries were really there, and really flushed
