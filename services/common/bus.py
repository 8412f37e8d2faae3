"""Typed publish and consume over Kafka (FastStream + aiokafka), with a dead-letter topic.

Publishing uses acks=all and the idempotent producer. A consumed record has one of three outcomes
besides being handled:

1. **schema error** (bad JSON, wrong shape, unknown ``schema_version``): sent, untouched, to
   ``<topic>.dlq`` at once with the reason in its headers; the consumer moves on.
2. **handler error** (anything else the handler raises): retried ``max_attempts`` times with a
   short backoff, then dead-lettered the same way.
3. **transient error** (:class:`~services.common.errors.TransientError`: a dependency such as the
   publisher or Redis is briefly down; or :class:`~services.common.errors.BusError`: Kafka itself):
   retried in place on the schedule in :class:`~services.common.settings.KafkaSettings`
   (``transient_backoff_*``, exponential with a cap, each retry logged) until it succeeds or the
   consumer stops; after ``transient_budget_s`` the record is left uncommitted (the error is
   raised) and Kafka redelivers it. Never dead-lettered.

A failed dead-letter publish also leaves the record uncommitted. ``bootstrap_servers="memory://"``
runs the same code on FastStream's in-memory broker.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaMessage

from schemas.base import Message, decode
from schemas.dead_letter import DeadLetter
from schemas.topics import TOPICS, TopicSpec, dlq_wire_name, wire_name
from services.common.errors import BusError, SchemaError, TransientError
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
MEMORY = "memory://"


@dataclass(frozen=True)
class RecordRef:
    """Where a consumed record sits: its identity when the content alone is not (a task sent twice)."""

    topic: str
    partition: int
    offset: int

    @property
    def key(self) -> str:
        """``<topic>/<partition>/<offset>``, zero-padded so that keys sort in log order per partition."""
        return f"{self.topic}/{self.partition:05d}/{self.offset:020d}"

DLQ_HEADERS = ("x-dlq-reason", "x-dlq-error-type", "x-dlq-source-topic", "x-dlq-source-partition",
               "x-dlq-source-offset", "x-dlq-consumer")


async def _raw_body(msg: Any) -> bytes:
    """Decoder that hands handlers the record's bytes untouched (we validate ourselves)."""
    return msg.body


class Bus:
    """One broker connection per process: topic naming, publishing, typed subscribers."""

    def __init__(self, settings: KafkaSettings, *, client_id: str | None = None) -> None:
        self.settings = settings
        self.in_memory = settings.bootstrap_servers == MEMORY
        self.broker = KafkaBroker(
            "localhost" if self.in_memory else settings.bootstrap_servers,
            client_id=client_id or settings.client_id,
            acks="all",
            enable_idempotence=True,
            request_timeout_ms=settings.request_timeout_ms,
            compression_type=None if settings.compression == "none" else settings.compression,
            max_batch_size=settings.max_batch_bytes,
            linger_ms=settings.linger_ms,
            logger=None,
        )
        self._topics: set[TopicSpec] = set()
        self._test_ctx: Any = None

    def name(self, spec: TopicSpec) -> str:
        """The topic's name on the wire, with this bus's namespace prefix."""
        return wire_name(self.settings, spec)

    def dlq_name(self, spec: TopicSpec) -> str:
        return dlq_wire_name(self.settings, spec)

    async def start(self, topics: tuple[TopicSpec, ...] = ()) -> None:
        """Create ``topics`` (and their DLQs) if missing, then connect."""
        self._topics.update(topics)
        if self.in_memory:
            from faststream.kafka import TestKafkaBroker

            self._test_ctx = TestKafkaBroker(self.broker)
            await self._test_ctx.__aenter__()
            return
        if self.settings.ensure_topics and self._topics:
            await ensure_topics(self.settings, [(self.name(s), s) for s in self._topics])
        try:
            await self.broker.start()
        except Exception as exc:  # aiokafka raises several unrelated types here
            raise BusError(f"cannot connect to Kafka at {self.settings.bootstrap_servers}: {exc}") from exc

    async def stop(self) -> None:
        if self._test_ctx is not None:
            await self._test_ctx.__aexit__(None, None, None)
            self._test_ctx = None
            return
        await self.broker.stop()

    def abort_producer(self) -> bool:
        """Stop the producer's sender without flushing: after a stop that timed out (the broker is gone)
        it would otherwise keep retrying its unacknowledged records in this process, and deliver them
        beside a later copy of the same records. True when there was one to stop."""
        config = getattr(self.broker, "config", None)
        for holder in (config, getattr(config, "broker_config", None)):
            real = getattr(getattr(getattr(holder, "producer", None), "_producer", None), "producer", None)
            task = getattr(getattr(real, "_sender", None), "sender_task", None)
            if task is not None:
                task.cancel()
                real._closed = True
                asyncio.ensure_future(real.client.close())
                return True
        return False

    async def publish(self, spec: TopicSpec, message: Message) -> None:
        """Publish ``message`` keyed by its id and wait for acks=all; failures raise BusError."""
        topic, value, key, headers = self.record_of(spec, message)
        await self.publish_raw(topic, value, key=key, headers=headers)

    def record_of(self, spec: TopicSpec, message: Message) -> tuple[str, bytes, bytes, dict[str, str]]:
        """What :meth:`publish` sends: wire topic, value, key (the message's id) and headers."""
        return (self.name(spec), message.to_bytes(), spec.key_of(message),
                {"content-type": "application/json",
                 "schema_version": str(getattr(message, "schema_version", ""))})

    async def publish_raw(self, topic: str, value: bytes, *, key: bytes | None,
                          headers: dict[str, str], timeout_s: float | None | Literal["setting"] = "setting") -> None:
        """Send one record and wait for acks=all, at most ``publish_timeout_s`` (the default), or
        ``timeout_s`` seconds, or (``None``) until the producer itself resolves it: with the idempotent
        producer it retries until the broker acknowledges, so an outage ends in the real outcome
        rather than in a timeout after which the record may still land."""
        limit = self.settings.publish_timeout_s if timeout_s == "setting" else timeout_s
        try:
            publishing = self.broker.publish(value, topic, key=key, headers=headers)
            if limit is None:
                await publishing
            else:
                await asyncio.wait_for(publishing, timeout=limit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise BusError(f"publish to {topic} failed: {type(exc).__name__}: {exc}") from exc

    def subscribe(
        self,
        spec: TopicSpec,
        handler: Callable[[M], Awaitable[None]],
        *,
        group_id: str,
        model: type[M] | None = None,
        max_attempts: int = 3,
        retry_backoff_s: float = 0.2,
        auto_offset_reset: str = "earliest",
        with_record: bool = False,
    ) -> Any:
        """Register ``handler`` for ``spec``'s topic: parse, retry, dead-letter, then commit.

        ``max_attempts``/``retry_backoff_s`` apply to handler errors; transient errors follow the
        settings' schedule instead (see the module docstring). ``with_record``: the handler also gets
        the record's :class:`RecordRef`.
        """
        model_cls: type[M] = model or spec.model  # type: ignore[assignment]
        bus = self

        async def _consume(body: bytes, msg: KafkaMessage) -> None:
            record = msg.raw_message
            try:
                parsed = decode(model_cls, body)
            except SchemaError as exc:
                await bus.dead_letter(spec, record, group_id, exc)
                return
            call = handler
            if with_record:
                ref = RecordRef(record.topic, record.partition, record.offset)

                async def call(message: M) -> None:
                    await handler(message, ref)  # type: ignore[call-arg]
            await bus._handle(spec, call, parsed, record, group_id, max_attempts, retry_backoff_s)

        _consume.__name__ = f"consume_{spec.name}_{group_id}".replace("-", "_").replace(".", "_")
        sub = self.broker.subscriber(
            self.name(spec), group_id=group_id, auto_offset_reset=auto_offset_reset,
            ack_policy=AckPolicy.NACK_ON_ERROR, decoder=_raw_body,
        )
        sub(_consume)
        return sub

    async def positioned(self, subscriber: Any, timeout_s: float) -> bool:
        """Wait until ``subscriber`` (what :meth:`subscribe` returned) has its partitions and knows the
        offset it reads from, so that a record published after this returns True is one it delivers.

        Why: with ``auto_offset_reset="latest"`` the offset is resolved some time after the broker
        starts (later still while a new topic elects its leader); a record published in between is
        skipped. False when the subscriber is not running (Kafka was unreachable at start) or is not
        positioned within ``timeout_s``; True at once on the in-memory bus, which delivers as it publishes.
        """
        if self.in_memory:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            consumer = getattr(subscriber, "consumer", None)
            if consumer is None:
                return False
            partitions = consumer.assignment()
            if partitions:
                try:
                    async with asyncio.timeout_at(deadline):
                        for tp in partitions:
                            await consumer.position(tp)
                    return True
                except TimeoutError:
                    return False
                except Exception as exc:  # a rebalance took the partition away meanwhile: look again
                    log.debug("positioning %s: %s: %s", partitions, type(exc).__name__, exc)
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0.0)))  # the group's join: no event to await

    async def _handle(self, spec: TopicSpec, handler: Callable[[M], Awaitable[None]], parsed: M, record: Any,
                      group_id: str, max_attempts: int, retry_backoff_s: float) -> None:
        """Run ``handler`` on one parsed record until it is handled, dead-lettered or given up on."""
        failures = retries = 0
        started = time.monotonic()
        while True:
            try:
                await handler(parsed)
                return
            except asyncio.CancelledError:
                raise
            except (TransientError, BusError) as exc:
                retries += 1
                delay = transient_delay(self.settings, retries)
                elapsed = time.monotonic() - started
                where = f"{record.topic}[{record.partition}]@{record.offset}"
                if elapsed + delay > self.settings.transient_budget_s:
                    log.error("%s still failing after %d retries in %.1f s (%s: %s); leaving it uncommitted "
                              "for redelivery", where, retries - 1, elapsed, type(exc).__name__, exc)
                    raise
                log.warning("%s: transient %s: %s; retry %d in %.2f s (%.1f s so far)", where,
                            type(exc).__name__, exc, retries, delay, elapsed)
                await asyncio.sleep(delay)
            except Exception as exc:
                failures += 1
                if failures >= max_attempts:
                    log.exception("handler failed %d times on %s; dead-lettering", failures, spec.name)
                    await self.dead_letter(spec, record, group_id, exc)
                    return
                await asyncio.sleep(retry_backoff_s * 2 ** (failures - 1))

    async def dead_letter(self, spec: TopicSpec, record: Any, consumer: str, exc: BaseException) -> None:
        """Send ``record``'s original bytes to the DLQ with the reason; raises if Kafka refuses."""
        reason = str(exc)[:2000] or type(exc).__name__
        log.warning("dead-lettering %s[%s]@%s: %s", record.topic, record.partition, record.offset, reason)
        headers = dict(zip(DLQ_HEADERS, (reason, type(exc).__name__, record.topic, str(record.partition),
                                         str(record.offset), consumer)))
        await self.publish_raw(self.dlq_name(spec), record.value or b"", key=record.key, headers=headers)


def transient_delay(settings: KafkaSettings, retry: int) -> float:
    """Seconds to wait before transient retry number ``retry`` (1-based): exponential, capped."""
    try:
        delay = settings.transient_backoff_initial_s * settings.transient_backoff_factor ** (retry - 1)
    except OverflowError:
        delay = settings.transient_backoff_max_s
    return min(delay, settings.transient_backoff_max_s)


def dead_letter_from_record(record: Any) -> DeadLetter:
    """Read a DLQ record (aiokafka ConsumerRecord) back into a :class:`DeadLetter`."""
    h = {k: v.decode() for k, v in (record.headers or ())}
    return DeadLetter(source_topic=h["x-dlq-source-topic"], source_partition=int(h["x-dlq-source-partition"]),
                      source_offset=int(h["x-dlq-source-offset"]), consumer=h["x-dlq-consumer"],
                      reason=h["x-dlq-reason"], error_type=h["x-dlq-error-type"],
                      original=record.value or b"", original_key=record.key)


async def publish_once(settings: KafkaSettings, spec: TopicSpec, message: Message, *, client_id: str) -> None:
    """Publish one message with a short-lived bus (for commands, not services)."""
    bus = Bus(settings, client_id=client_id)
    await bus.start((spec,))
    try:
        await bus.publish(spec, message)
    finally:
        await bus.stop()


async def ensure_topics(settings: KafkaSettings, topics: list[tuple[str, TopicSpec]]) -> None:
    """Create each topic and its DLQ with the registry's partitions and retention, if missing."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers,
                                request_timeout_ms=settings.request_timeout_ms)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = []
        for name, spec in topics:
            cfg = {"retention.ms": str(spec.retention_ms)}
            if name not in existing:
                wanted.append(NewTopic(name, spec.partitions, 1, topic_configs=cfg))
            if f"{name}.dlq" not in existing:
                wanted.append(NewTopic(f"{name}.dlq", 1, 1, topic_configs=cfg))
        if wanted:
            resp = await admin.create_topics(wanted)
            _raise_on_create_errors(resp)
    except BusError:
        raise
    except Exception as exc:
        raise BusError(f"cannot create topics on {settings.bootstrap_servers}: {exc}") from exc
    finally:
        await admin.close()


def _raise_on_create_errors(resp: Any) -> None:
    """Raise unless every create succeeded or the topic already existed (error 36)."""
    for name, code, *rest in getattr(resp, "topic_errors", ()):
        if code not in (0, 36):
            raise BusError(f"create topic {name} failed with Kafka error {code}: {rest}")


__all__ = ["Bus", "MEMORY", "TOPICS", "dead_letter_from_record", "ensure_topics", "transient_delay"]
