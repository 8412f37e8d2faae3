"""Read topics without a consumer group (never moving any service's offsets).

:func:`read_topic` is the one typed reader: every message of a registry topic that exists now,
decoded into its model (:func:`read_topic_records` adds key, partition, offset and timestamp).
:func:`read_messages` follows a topic from a point in time, for tools and tests that watch
results arrive. :func:`read_to_end`/:func:`read_records_to_end` are the raw-bytes layer below,
for a topic given by its wire name. :class:`KeyWatch` says which keys a topic holds since a time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar, overload

from schemas.base import Message, decode
from schemas.topics import TopicSpec, wire_name
from services.common.errors import SchemaError
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


async def read_to_end(settings: KafkaSettings, name: str) -> AsyncIterator[bytes]:
    """Every record value of topic ``name`` that exists now."""
    async for rec in read_records_to_end(settings, name):
        yield rec.value


async def read_records_to_end(settings: KafkaSettings, name: str) -> AsyncIterator[Any]:
    """Every record (aiokafka ConsumerRecord: value, key, timestamp, partition, offset) of
    topic ``name`` that exists now; within a partition in offset order."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(name, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = list(consumer.assignment())
        if not tps:
            return
        ends = await consumer.end_offsets(tps)
        async for rec in _until_ends(consumer, await consumer.beginning_offsets(tps), ends):
            yield rec
    finally:
        await consumer.stop()


async def _until_ends(consumer: Any, starts: dict[Any, int], ends: dict[Any, int]) -> AsyncIterator[Any]:
    """Each partition's records from ``starts[tp]`` up to, not including, ``ends[tp]``, in offset order."""
    for tp, start in starts.items():
        consumer.seek(tp, start)
    left = {tp for tp in starts if ends[tp] > starts[tp]}
    while left:
        batch = await consumer.getmany(*left, timeout_ms=1000)
        for tp, records in batch.items():
            for rec in records:
                if rec.offset < ends[tp]:
                    yield rec
        for tp in list(left):
            if await consumer.position(tp) >= ends[tp]:
                left.discard(tp)


class KeyWatch:
    """The keys of topic ``name``'s records appended at or after ``since_ms``, read incrementally, no group.

    Why: a send that failed on the client may still have been written by the broker (a lost answer, a
    producer the broker stopped trusting mid-batch). Before sending such a record again, its producer asks
    whether its key is already there. Each :meth:`refresh` reads on from where the last one stopped.
    """

    def __init__(self, settings: KafkaSettings, name: str, since_ms: int) -> None:
        self.settings, self.name, self.since_ms = settings, name, since_ms
        self.positions: dict[int, int] = {}  # partition -> next offset to read
        self.keys: set[bytes] = set()

    async def refresh(self) -> set[bytes]:
        """Read every record appended since the last refresh (the first: since ``since_ms``) up to the
        partitions' ends now; the keys seen so far. Progress is kept if it is cancelled half way."""
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(self.name, bootstrap_servers=self.settings.bootstrap_servers, group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        try:
            await consumer.start()
            tps = sorted(consumer.assignment())
            if not tps:
                return self.keys
            ends = await consumer.end_offsets(tps)
            new = [tp for tp in tps if tp.partition not in self.positions]
            if new:
                found = await consumer.offsets_for_times({tp: self.since_ms for tp in new})
                for tp in new:
                    self.positions[tp.partition] = ends[tp] if found.get(tp) is None else found[tp].offset
            async for rec in _until_ends(consumer, {tp: self.positions[tp.partition] for tp in tps}, ends):
                if rec.key is not None:
                    self.keys.add(rec.key)
                self.positions[rec.partition] = rec.offset + 1
            self.positions.update({tp.partition: ends[tp] for tp in tps})
        finally:
            await consumer.stop()
        return self.keys


OnUnreadable = Callable[[Any, SchemaError], None]


@dataclass(frozen=True)
class TopicRecord(Generic[M]):
    """One decoded record: the message and where it sits on the topic."""

    message: M
    key: bytes | None
    partition: int
    offset: int
    timestamp_ms: int  # when the broker appended it (CreateTime as sent by the producer)


def _ms(t: datetime | None) -> int | None:
    return None if t is None else int(t.timestamp() * 1000)


@overload
def read_topic_records(settings: KafkaSettings, spec: TopicSpec, *, model: type[M], since: datetime | None = ...,
                       until: datetime | None = ..., on_unreadable: OnUnreadable | None = ...,
                       strict: bool = ...) -> AsyncIterator[TopicRecord[M]]: ...
@overload
def read_topic_records(settings: KafkaSettings, spec: TopicSpec, *, model: None = ...,
                       since: datetime | None = ..., until: datetime | None = ...,
                       on_unreadable: OnUnreadable | None = ...,
                       strict: bool = ...) -> AsyncIterator[TopicRecord[Any]]: ...
async def read_topic_records(settings: KafkaSettings, spec: TopicSpec, *, model: type[M] | None = None,
                             since: datetime | None = None, until: datetime | None = None,
                             on_unreadable: OnUnreadable | None = None,
                             strict: bool = False) -> AsyncIterator[TopicRecord[Any]]:
    """Every record of ``spec``'s topic that exists now, decoded, with its key/partition/offset/timestamp.

    Like :func:`read_topic`, whose arguments these are.
    """
    name = wire_name(settings, spec)
    model_cls: type[Message] = model or spec.model
    lo, hi = _ms(since), _ms(until)
    skipped = 0
    try:
        async for rec in read_records_to_end(settings, name):
            if (lo is not None and rec.timestamp < lo) or (hi is not None and rec.timestamp >= hi):
                continue
            try:
                message = decode(model_cls, rec.value)
            except SchemaError as exc:
                if strict:
                    raise SchemaError(f"{name}[{rec.partition}]@{rec.offset}: {exc}") from exc
                skipped += 1
                log.debug("%s[%d]@%d: unreadable, skipped: %s", name, rec.partition, rec.offset, exc)
                if on_unreadable is not None:
                    on_unreadable(rec, exc)
                continue
            yield TopicRecord(message, rec.key, rec.partition, rec.offset, rec.timestamp)
    finally:
        if skipped:
            log.info("%s: skipped %d unreadable record(s) (the topic's consumers dead-letter them)", name, skipped)


@overload
def read_topic(settings: KafkaSettings, spec: TopicSpec, *, model: type[M], since: datetime | None = ...,
               until: datetime | None = ..., on_unreadable: OnUnreadable | None = ...,
               strict: bool = ...) -> AsyncIterator[M]: ...
@overload
def read_topic(settings: KafkaSettings, spec: TopicSpec, *, model: None = ..., since: datetime | None = ...,
               until: datetime | None = ..., on_unreadable: OnUnreadable | None = ...,
               strict: bool = ...) -> AsyncIterator[Any]: ...
async def read_topic(settings: KafkaSettings, spec: TopicSpec, *, model: type[M] | None = None,
                     since: datetime | None = None, until: datetime | None = None,
                     on_unreadable: OnUnreadable | None = None, strict: bool = False) -> AsyncIterator[Any]:
    """Every message of ``spec``'s topic that exists now, decoded into ``model`` (default: the
    registry's ``spec.model``); within a partition in offset order, then the read ends.

    - ``settings``: the Kafka connection; the wire name is ``wire_name(settings, spec)``
      (``settings.topic_namespace + spec.name``), the same as ``Bus.name``.
    - ``since``/``until``: only records the broker appended at or after ``since`` and before
      ``until`` (the record timestamps; either may be None). For "at or before T" pass
      ``until=T + timedelta(milliseconds=1)``.
    - a record that does not decode (bad JSON, wrong shape, unknown ``schema_version``) is skipped
      and counted (one log line at the end); ``on_unreadable(record, error)`` is called for each,
      to count or report them. ``strict=True`` raises :class:`SchemaError` naming the record instead.

    Reads with no consumer group: no service's offsets move. Example::

        async for v in read_topic(settings.kafka, topic("verdicts")):
            ...
    """
    async for rec in read_topic_records(settings, spec, model=model, since=since, until=until,
                                        on_unreadable=on_unreadable, strict=strict):
        yield rec.message


async def read_messages(settings: KafkaSettings, spec: TopicSpec, model: type[M], *,
                        limit: int | None = None, idle_s: float = 5.0,
                        since: datetime | None = None) -> AsyncIterator[M]:
    """Messages appended at or after ``since`` (else all), until ``limit`` or ``idle_s`` of quiet.

    Unreadable records are logged and skipped (the consumers dead-letter them).
    """
    from aiokafka import AIOKafkaConsumer

    name = wire_name(settings, spec)
    consumer = AIOKafkaConsumer(name, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    seen = 0
    try:
        tps = sorted(consumer.assignment())
        if not tps:
            return
        if since is not None:
            # End offsets first: a record appended after this read is at or past them, so it is
            # never skipped when no record at or after ``since`` exists yet.
            ends = await consumer.end_offsets(tps)
            found = await consumer.offsets_for_times({tp: int(since.timestamp() * 1000) for tp in tps})
            for tp in tps:
                consumer.seek(tp, ends[tp] if found.get(tp) is None else found[tp].offset)
        while limit is None or seen < limit:
            batch = await consumer.getmany(timeout_ms=int(idle_s * 1000))
            if not batch:
                return
            for records in batch.values():
                for rec in records:
                    try:
                        message = decode(model, rec.value)
                    except SchemaError as exc:
                        log.warning("%s@%d: unreadable: %s", name, rec.offset, exc)
                        continue
                    yield message
                    seen += 1
                    if limit is not None and seen >= limit:
                        return
    finally:
        await consumer.stop()



async def follow_topic_records(settings: KafkaSettings, spec: TopicSpec, *, model: type[M] | None = None,
                               start: dict[int, int] | None = None, poll_ms: int = 1000, max_records: int = 500,
                               retry_s: float = 2.0, on_unreadable: OnUnreadable | None = None
                               ) -> AsyncIterator[list[TopicRecord[Any]]]:
    """Follow ``spec``'s topic for as long as the caller iterates: batches of decoded records, each partition
    from ``start[partition]`` (the next offset to read; absent: the beginning), an empty batch on each quiet
    ``poll_ms``. No consumer group, so no service's offsets move.

    For a reader that keeps its own offsets beside what it stored (the console): it resumes where its store
    says, so a restart neither loses nor repeats a record it committed. A topic that does not exist yet is
    waited for (every ``retry_s``). An unreadable record comes with ``message`` None (its offset still counts;
    the topic's consumers dead-letter it) and is passed to ``on_unreadable``.
    """
    import asyncio

    from aiokafka import AIOKafkaConsumer

    name = wire_name(settings, spec)
    model_cls: type[Message] = model or spec.model
    start = dict(start or {})
    while True:  # with no group, a consumer named for a topic is assigned all its partitions once it exists
        consumer = AIOKafkaConsumer(name, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        if consumer.assignment():
            break
        await consumer.stop()
        yield []
        await asyncio.sleep(retry_s)
    try:
        tps = sorted(consumer.assignment())
        for tp in tps:
            if tp.partition in start:
                consumer.seek(tp, start[tp.partition])
            else:
                await consumer.seek_to_beginning(tp)
        while True:
            batch = await consumer.getmany(timeout_ms=poll_ms, max_records=max_records)
            out: list[TopicRecord[Any]] = []
            for records in batch.values():
                for rec in records:
                    try:
                        message = decode(model_cls, rec.value)
                    except SchemaError as exc:
                        log.debug("%s[%d]@%d: unreadable, skipped: %s", name, rec.partition, rec.offset, exc)
                        if on_unreadable is not None:
                            on_unreadable(rec, exc)
                        out.append(TopicRecord(None, rec.key, rec.partition, rec.offset, rec.timestamp))
                        continue
                    out.append(TopicRecord(message, rec.key, rec.partition, rec.offset, rec.timestamp))
            yield out
    finally:
        await consumer.stop()
