"""The rollout ledger on a real redis-server: accepted, done and pending across two clients (a restart), and
an entry that no longer parses is skipped and left in place instead of stopping the runner's start."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from services.common.bus import RecordRef
from services.episodes.tasks import build_task
from services.rollouts.ledger import ledger
from tests.support.records import NOW, judged_trace, verdict_for

pytestmark = [pytest.mark.redis]


async def test_a_restarted_ledger_sees_what_is_pending_and_skips_a_broken_entry(redis_url):
    ns, group = f"lg{uuid.uuid4().hex[:8]}.", "rollouts-test"
    tasks = [build_task(judged_trace(f"t-{i}"), verdict_for(f"t-{i}"), now=NOW) for i in range(3)]
    keys = [RecordRef("tasks", 0, i).key for i in range(3)]
    first = ledger(redis_url, ns, group)
    try:
        assert [await first.accept(k, t) for k, t in zip(keys, tasks)] == [True, True, True]
        assert not await first.accept(keys[0], tasks[0])  # a redelivery of a pending record
        await first.done(keys[1])
        assert not await first.accept(keys[1], tasks[1])  # a redelivery of a done record
    finally:
        await first.close()
    raw = aioredis.Redis.from_url(redis_url)
    pending_key = f"{ns}rollouts:ledger:{group}:pending"
    try:
        await raw.hset(pending_key, "tasks/00000/zz-garbage", b"{not json")
        again = ledger(redis_url, ns, group)  # what a restarted runner opens
        try:
            assert [(k, t.task_id) for k, t in await again.pending()] == [(keys[0], tasks[0].task_id),
                                                                         (keys[2], tasks[2].task_id)]
        finally:
            await again.close()
        assert await raw.hlen(pending_key) == 3  # nothing deleted: the broken entry waits for a person
    finally:
        await raw.aclose()
