"""Transient errors on the in-memory bus: retried in place on a bounded schedule, never dead-lettered;
and how the sampler and the Redis stores classify what failed."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest
from pydantic import ValidationError

from schemas import AdapterPublished, Trace, topic
from services.common.adapter_files import HashMismatch
from services.common.bus import Bus, transient_delay
from services.common.errors import BusError, TransientError
from services.common.idempotency import RedisKeyStore, redis_transient
from services.common.publisher_client import PublisherClientError
from services.common.settings import KafkaSettings
from services.sampler.registry import AdapterEntry, AdapterRegistry, AdapterUnavailable
from services.sampler.worker import (
    AdapterStore,
    AdapterWorker,
    SourceUnreachable,
    is_unreachable,
)
from tests.support.poll import eventually
from tests.support.records import NOW, trace

FAST = dict(bootstrap_servers="memory://", transient_backoff_initial_s=0.01, transient_backoff_max_s=0.02,
            transient_budget_s=10.0)


class DeadLetters:
    """Stands in for ``Bus.dead_letter``: remembers what would have gone to the DLQ."""

    def __init__(self) -> None:
        self.got: list[tuple[str, BaseException]] = []

    async def __call__(self, spec, record, consumer, exc) -> None:
        self.got.append((spec.name, exc))


def _record() -> SimpleNamespace:
    return SimpleNamespace(topic="traces", partition=0, offset=7, key=b"t1", value=b"{}")


# ------------------------------------------------------------------ the schedule

def test_schedule_is_exponential_and_capped():
    s = KafkaSettings(transient_backoff_initial_s=0.25, transient_backoff_factor=2, transient_backoff_max_s=5)
    assert [transient_delay(s, n) for n in range(1, 9)] == [0.25, 0.5, 1, 2, 4, 5, 5, 5]
    assert transient_delay(s, 100_000) == 5  # no overflow, still the cap
    flat = KafkaSettings(transient_backoff_initial_s=1, transient_backoff_factor=1, transient_backoff_max_s=1)
    assert {transient_delay(flat, n) for n in range(1, 20)} == {1}


def test_schedule_settings_are_bounded():
    defaults = KafkaSettings()
    assert 0 < defaults.transient_backoff_initial_s <= defaults.transient_backoff_max_s
    assert defaults.transient_budget_s >= 60  # minutes of outage, not the old 0.6 s
    for bad in ({"transient_backoff_initial_s": 0}, {"transient_backoff_factor": 0.5},
                {"transient_backoff_max_s": 61}, {"transient_budget_s": 300},
                {"transient_backoff_initial_s": 2, "transient_backoff_max_s": 1}):
        with pytest.raises(ValidationError):
            KafkaSettings(**bad)
    for name in ("transient_backoff_initial_s", "transient_backoff_factor", "transient_backoff_max_s",
                 "transient_budget_s"):
        assert KafkaSettings.model_fields[name].description


def test_transient_error_is_one_of_ours_and_a_connection_error():
    from services.common.errors import FanrouteError

    assert issubclass(TransientError, FanrouteError) and issubclass(TransientError, ConnectionError)
    assert issubclass(SourceUnreachable, TransientError) and issubclass(SourceUnreachable, AdapterUnavailable)


# ------------------------------------------------------------------ the bus (in-memory broker)

async def test_transient_failures_are_retried_past_max_attempts_and_never_dead_lettered(caplog):
    bus = Bus(KafkaSettings(**FAST))
    bus.dead_letter = dlq = DeadLetters()  # type: ignore[method-assign]
    calls: list[str] = []

    async def handle(t: Trace) -> None:
        calls.append(t.trace_id)
        if len(calls) <= 6:  # twice max_attempts
            raise TransientError("publisher down")

    bus.subscribe(topic("traces"), handle, group_id="g", max_attempts=3)
    await bus.start((topic("traces"),))
    try:
        with caplog.at_level(logging.WARNING, logger="services.common.bus"):
            await bus.publish(topic("traces"), trace("t1"))
            await eventually(lambda: len(calls) >= 7, timeout_s=10, what="the seventh call", interval_s=0.01)
    finally:
        await bus.stop()
    assert calls == ["t1"] * 7 and dlq.got == []
    retries = [r for r in caplog.records if "transient TransientError" in r.getMessage()]
    assert len(retries) == 6 and "retry 6" in retries[-1].getMessage()  # each retry logged


@pytest.mark.parametrize(("error", "failures", "calls", "dead"), [
    # Kafka itself failing inside a handler (e.g. its own publish): the transient path, never the DLQ
    (BusError("publish to verdicts failed: KafkaTimeoutError"), 4, 5, []),
    # the record's own failure: max_attempts (3) tries, then the DLQ with the reason
    (RuntimeError("bad record"), 99, 3, [("traces", "bad record")]),
])
async def test_a_handler_error_is_retried_in_place_or_dead_lettered(error, failures, calls, dead):
    bus = Bus(KafkaSettings(**FAST))
    bus.dead_letter = dlq = DeadLetters()  # type: ignore[method-assign]
    n = 0

    async def handle(t: Trace) -> None:
        nonlocal n
        n += 1
        if n <= failures:
            raise error

    await bus._handle(topic("traces"), handle, trace(), _record(), "g", 3, 0.0)
    assert n == calls and [(name, str(e)) for name, e in dlq.got] == dead


async def test_after_the_budget_the_record_is_left_uncommitted_not_dead_lettered(caplog):
    bus = Bus(KafkaSettings(**{**FAST, "transient_budget_s": 0.2}))
    bus.dead_letter = dlq = DeadLetters()  # type: ignore[method-assign]

    async def handle(t: Trace) -> None:
        raise TransientError("redis down")

    with caplog.at_level(logging.ERROR, logger="services.common.bus"), pytest.raises(TransientError):
        await bus._handle(topic("traces"), handle, trace(), _record(), "g", 3, 0.0)
    assert dlq.got == []
    assert any("leaving it uncommitted" in r.getMessage() for r in caplog.records)


async def test_a_stopping_consumer_cancels_the_retry_loop():
    bus = Bus(KafkaSettings(**{**FAST, "transient_backoff_initial_s": 5, "transient_backoff_max_s": 5,
                               "transient_budget_s": 200}))
    bus.dead_letter = dlq = DeadLetters()  # type: ignore[method-assign]
    tried = asyncio.Event()

    async def handle(t: Trace) -> None:
        tried.set()
        raise TransientError("down")

    task = asyncio.create_task(bus._handle(topic("traces"), handle, trace(), _record(), "g", 3, 0.0))
    await asyncio.wait_for(tried.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)  # not swallowed, not waiting out the 5 s backoff
    assert dlq.got == []


# ------------------------------------------------------------------ the sampler's classification

def _publisher_error(cause: BaseException | None, status: int | None) -> PublisherClientError:
    try:
        try:
            if cause is not None:
                raise cause
            raise PublisherClientError("GET x: HTTP", status=status)
        except PublisherClientError:
            raise
        except Exception as exc:
            raise PublisherClientError(f"GET x: {type(exc).__name__}", status=status) from exc
    except PublisherClientError as exc:
        return exc


def _status_error(code: int) -> httpx.HTTPStatusError:
    req = httpx.Request("GET", "http://publisher/f")
    return httpx.HTTPStatusError("x", request=req, response=httpx.Response(code, request=req))


@pytest.mark.parametrize(("exc", "transient"), [
    (_publisher_error(httpx.ConnectError("refused"), None), True),
    (_publisher_error(httpx.ReadTimeout("slow"), None), True),
    (_publisher_error(None, 503), True),
    (_publisher_error(None, 500), True),
    (_publisher_error(None, 404), False),
    (_publisher_error(None, 400), False),
    (PublisherClientError("manifest files differ from the announced"), False),  # status None, not a network error
    (HashMismatch("adapter_model.safetensors: received bytes hash to ..."), False),
    (_status_error(502), True),
    (_status_error(403), False),
    (httpx.ConnectTimeout("t"), True),
    (ConnectionRefusedError(111, "refused"), True),
    (FileNotFoundError("no such version"), False),
])
def test_publisher_unreachable_is_transient_and_refusals_are_not(exc, transient):
    assert is_unreachable(exc) is transient


def adapter_published(version: int = 1) -> AdapterPublished:
    return AdapterPublished(model_id="router", version=version, base_model="tiny-base",
                            url=f"http://publisher/v1/adapters/router/versions/{version}",
                            files_sha256={"adapter_config.json": "0" * 64, "adapter_model.safetensors": "1" * 64},
                            published_at=NOW)


class FakeSampler:
    def __init__(self) -> None:
        self.registry = AdapterRegistry(4)

    async def register(self, entry: AdapterEntry) -> None:
        self.registry.add(entry)


@pytest.mark.parametrize(("raised", "transient"), [
    (_publisher_error(httpx.ConnectError("refused"), None), True),
    (_publisher_error(None, 503), True),
    (_publisher_error(None, 404), False),
    (HashMismatch("adapter_model.safetensors: bad"), False),
])
async def test_the_adapter_worker_raises_transient_only_for_an_unreachable_source(tmp_path, raised, transient):
    def fetcher(*args):
        raise raised

    worker = AdapterWorker(FakeSampler(), AdapterStore(tmp_path, fetcher))
    with pytest.raises(AdapterUnavailable) as info:
        await worker.handle(adapter_published())
    assert isinstance(info.value, TransientError) is transient
    assert list(tmp_path.rglob("*.partial*")) == []  # nothing half-pulled is left either way


# ------------------------------------------------------------------ Redis

def test_redis_connection_errors_become_transient_and_others_do_not():
    import redis.exceptions as rx

    for err in (rx.ConnectionError("refused"), rx.TimeoutError("slow"), rx.BusyLoadingError("loading")):
        with pytest.raises(TransientError, match="key store: Redis unavailable"):
            with redis_transient("key store"):
                raise err
    with pytest.raises(rx.ResponseError):
        with redis_transient("key store"):
            raise rx.ResponseError("WRONGTYPE")


async def test_a_redis_key_store_that_cannot_connect_raises_transient():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisKeyStore(f"redis://127.0.0.1:{port}/0", "p")
    try:
        with pytest.raises(TransientError):
            await store.seen("k")
        with pytest.raises(TransientError):
            await store.mark("k")
    finally:
        await store.close()
