"""Following the promoted router version: Redis at start, the adapters topic as it happens, Redis
polled as a backstop; the latest promotion wins (a rollback too), and nothing promoted is no error."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import AdapterPublished, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings
from services.common.stamps import MemoryStampStore, parse_promoted
from services.gateway.follow import Promoted, PromotedFollower


def announcement(version: int, *, promoted: bool = True, model_id: str = "router",
                 fallback_provider: str | None = None) -> AdapterPublished:
    return AdapterPublished(model_id=model_id, version=version, base_model="tiny", url=f"http://pub/v{version}",
                            files_sha256={}, published_at=datetime.now(UTC), promoted=promoted,
                            fallback_provider=fallback_provider)


class GarbledStamps(MemoryStampStore):
    """A promoted key whose value someone overwrote with something that is not its JSON."""

    async def promoted(self, model_id: str):
        return parse_promoted(b"router@3, please")


class BrokenStamps(MemoryStampStore):
    async def promoted(self, model_id: str):
        raise ConnectionError("redis is down")


@pytest.fixture
async def follow():
    """``await follow(stamps, poll_s=...)``: a started follower on the in-memory bus, and its bus."""
    started: list[tuple[PromotedFollower, Bus]] = []

    async def start(stamps: MemoryStampStore | None = None, *, poll_s: float = 3600.0):
        bus = Bus(KafkaSettings(bootstrap_servers="memory://"))
        seen: list[Promoted] = []
        follower = PromotedFollower("router", bus, stamps=stamps, poll_s=poll_s, group_id="gw-test",
                                    on_change=seen.append)
        follower.subscribe()
        await bus.start((topic("adapters"),))
        await follower.start()
        started.append((follower, bus))
        return follower, bus, seen

    yield start
    for follower, bus in started:
        await follower.stop()
        await bus.stop()


def at(version: int):
    return lambda p: p is not None and p.version == version


async def test_nothing_promoted_is_not_an_error(follow):
    follower, _, seen = await follow(MemoryStampStore())
    assert follower.current is None and seen == []


async def test_start_reads_the_promoted_key(follow):
    stamps = MemoryStampStore()
    await stamps.set_promoted("router", 3, "bm25-all")
    follower, _, seen = await follow(stamps)
    assert follower.current == Promoted(3, "router@3", "bm25-all") and seen == [follower.current]


async def test_topic_promotions_of_our_model_id_are_followed_latest_wins(follow):
    follower, bus, _ = await follow()
    await bus.publish(topic("adapters"), announcement(1, promoted=False))  # published, not promoted
    await bus.publish(topic("adapters"), announcement(5, model_id="other"))
    assert follower.current is None
    for v in (1, 2, 1):  # the rollback to 1 is the newest promotion
        await bus.publish(topic("adapters"), announcement(v, fallback_provider=f"p{v}"))
        await follower.wait_for(at(v), 5)
    assert follower.current == Promoted(1, "router@1", "p1")


async def test_redis_poll_applies_changes_but_never_undoes_a_newer_topic_promotion(follow):
    stamps = MemoryStampStore()
    await stamps.set_promoted("router", 1, None)
    follower, bus, _ = await follow(stamps)
    await bus.publish(topic("adapters"), announcement(2))  # the topic is ahead of the key
    await follower.wait_for(at(2), 5)
    await follower.poll_once()
    assert follower.current.version == 2  # the unchanged key (1) is old news
    await stamps.set_promoted("router", 3, "b")  # a promotion the topic never delivered
    await follower.poll_once()
    assert follower.current == Promoted(3, "router@3", "b")


async def test_the_poll_runs_by_itself(follow):
    stamps = MemoryStampStore()
    follower, _, _ = await follow(stamps, poll_s=0.02)
    await stamps.set_promoted("router", 7, None)
    assert (await follower.wait_for(at(7), 5)).router == "router@7"


async def test_redis_down_at_start_is_a_warning_not_a_failure(follow, caplog):
    follower, bus, _ = await follow(BrokenStamps())
    assert follower.current is None and "redis is down" in caplog.text
    await follower.poll_once()  # the poll survives it too
    await bus.publish(topic("adapters"), announcement(1))
    await follower.wait_for(at(1), 5)


async def test_a_garbled_promoted_key_is_a_warning_and_keeps_what_is_followed(follow, caplog):
    follower, bus, _ = await follow(GarbledStamps())
    assert follower.current is None and "cannot read the promoted version" in caplog.text
    await bus.publish(topic("adapters"), announcement(2))
    await follower.wait_for(at(2), 5)
    await follower.poll_once()  # the garbled key does not undo what the topic delivered
    assert follower.current.version == 2


class OrderedBus:
    """A bus that records when the tail is positioned and when the topic is replayed, in order."""

    in_memory = False
    settings = KafkaSettings(bootstrap_servers="127.0.0.1:1")

    def __init__(self, positioned: bool) -> None:
        self.calls: list[str] = []
        self._positioned = positioned

    def subscribe(self, *args, **kwargs):
        return "tail"

    async def positioned(self, subscriber, timeout_s: float) -> bool:
        self.calls.append(f"positioned {subscriber}")
        return self._positioned


@pytest.mark.parametrize("ready", [True, False])
async def test_the_tail_is_positioned_before_the_topic_is_replayed(ready, monkeypatch, caplog):
    """A promotion published during start lands before the replay's end or at the tail's offset."""
    bus = OrderedBus(ready)

    async def replay(settings, spec, *, model):
        bus.calls.append("replay")
        yield announcement(2)

    monkeypatch.setattr("services.gateway.follow.read_topic", replay)
    follower = PromotedFollower("router", bus, stamps=None, poll_s=3600.0, group_id="gw-test")  # type: ignore[arg-type]
    follower.subscribe()
    await follower.start()
    assert bus.calls == ["positioned tail", "replay"]
    assert follower.current == Promoted(2, "router@2", None)
    assert ("tail has no offset yet" in caplog.text) is (not ready)
