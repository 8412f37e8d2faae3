"""The rollout ledger's pending entries rebuilt from the topics after Redis lost them.

Why: the runner commits a task record's offset once the ledger has it, so a flushed ledger (FLUSHALL, a
restart without persistence) would leave every accepted, unpublished group in memory only — a runner
killed next would never run them. Both halves of the ledger are on the topics: the records accepted are
the runner group's ``tasks`` records below its committed offsets, and a group is done when ``rollouts``
holds its id (:func:`~services.rollouts.worker.group_id_of` of the record's key). One approximation: a
group dropped without publishing (a broken task) counts as pending again and runs once more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from schemas.task import Task
from schemas.topics import topic, wire_name
from services.common.bus import RecordRef
from services.common.errors import BusError
from services.common.replay_topic import read_topic, read_topic_records
from services.common.settings import KafkaSettings
from services.rollouts.ledger import Ledger

log = logging.getLogger(__name__)


async def committed_offsets(kafka: KafkaSettings, group_id: str, wire_topic: str) -> dict[int, int]:
    """The consumer group's committed offset per partition of ``wire_topic`` (absent: nothing committed)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import CoordinatorLoadInProgressError, GroupCoordinatorNotAvailableError

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers, request_timeout_ms=kafka.request_timeout_ms)
    delay, deadline = 0.1, asyncio.get_running_loop().time() + kafka.request_timeout_ms / 1000
    try:
        await admin.start()
        while True:
            try:
                offsets = await admin.list_consumer_group_offsets(group_id)
                break
            except (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError):
                # a new broker creates its offsets topic on the first ask: the coordinator comes soon
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
    except Exception as exc:
        raise BusError(f"cannot read group {group_id}'s offsets on {kafka.bootstrap_servers}: {exc}") from exc
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == wire_topic and meta.offset >= 0}


async def rebuild_ledger(kafka: KafkaSettings, ledger: Ledger, consumer_group: str,
                         group_id_of: Callable[[str], str]) -> int:
    """Accept again every committed ``tasks`` record whose group is not on ``rollouts``; returns how many."""
    tasks_wire = wire_name(kafka, topic("tasks"))
    committed = await committed_offsets(kafka, consumer_group, tasks_wire)
    published = {g.group_id async for g in read_topic(kafka, topic("rollouts"))}
    n = 0
    async for rec in read_topic_records(kafka, topic("tasks"), model=Task):
        if rec.offset >= committed.get(rec.partition, 0):
            continue  # not committed: the consumer delivers it again and the ledger takes it then
        key = RecordRef(tasks_wire, rec.partition, rec.offset).key
        if group_id_of(key) not in published and await ledger.accept(key, rec.message):
            n += 1
    log.info("rollout ledger not in Redis (a first start, or Redis lost it); rebuilt from the topics: %d "
             "accepted groups not yet on rollouts are pending again", n)
    return n
