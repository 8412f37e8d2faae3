"""Read back what a test's run wrote on a real topic (a fresh namespace: nothing else wrote there)."""

from __future__ import annotations

from typing import TypeVar

from schemas import topic
from schemas.topics import wire_name
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from tests.support.poll import eventually

M = TypeVar("M")


async def topic_records(kafka: KafkaSettings, name: str, model: type[M]) -> list[M]:
    """Every record now on topic ``name`` of ``kafka``'s namespace, decoded strictly as ``model``."""
    return [m async for m in read_topic(kafka, topic(name), model=model, strict=True)]


async def wait_for_records(kafka: KafkaSettings, name: str, model: type[M], n: int, *, timeout_s: float,
                           what: str | None = None) -> list[M]:
    """Every record on topic ``name`` once there are ``n`` or more; fails after ``timeout_s`` naming ``what``."""

    async def at_least() -> list[M] | None:
        got = await topic_records(kafka, name, model)
        return got if len(got) >= n else None

    return await eventually(at_least, timeout_s=timeout_s, what=what or f"{n} records on {name!r}", interval_s=0.2)


async def group_caught_up(kafka: KafkaSettings, group: str, name: str = "traces") -> bool:
    """Whether consumer group ``group`` has committed the end of every partition of topic ``name``."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import GroupCoordinatorNotAvailableError

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    probe = AIOKafkaConsumer(wire_name(kafka, topic(name)), bootstrap_servers=kafka.bootstrap_servers,
                             group_id=None)
    await admin.start()
    await probe.start()
    try:
        ends = await probe.end_offsets(list(probe.assignment()))
        try:
            done = await admin.list_consumer_group_offsets(group)
        except GroupCoordinatorNotAvailableError:  # the group has not joined yet: it has committed nothing
            return False
        return all(done.get(tp) is not None and done[tp].offset >= end for tp, end in ends.items())
    finally:
        await probe.stop()
        await admin.close()
