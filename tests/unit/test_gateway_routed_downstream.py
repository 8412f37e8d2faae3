"""Routed traces are biased labels (only the chosen provider answered): the episode builder never turns
them into episodes, and the judge samples them at the rate only, never as contested."""

from __future__ import annotations

import pytest

from schemas import topic
from schemas.trace import Trace
from services.common.idempotency import MemoryKeyStore
from services.episodes.state import MemoryJoinStore
from services.episodes.worker import EpisodeBuilder
from services.judge.sampling import sample_reason
from tests.support.bus import collecting
from tests.support.records import judged_trace, verdict_for


def routed_trace(trace_id: str, *, contested: bool = True) -> Trace:
    """A judged trace as routed mode would have written it: one provider called."""
    data = judged_trace(trace_id, contested=contested).model_dump(mode="json")
    data.update(mode="routed", router_version="router@1", candidates=data["candidates"][:1],
                route={"router": "router@1", "ordering": ["bm25-all"], "called": ["bm25-all"]})
    return Trace.model_validate(data)


@pytest.fixture
async def builder():
    async with collecting(topic("episodes")) as (bus, episodes):
        state = MemoryJoinStore()
        yield EpisodeBuilder(bus, state, MemoryKeyStore()), state, episodes


def skipped(b: EpisodeBuilder, record: str) -> float:
    return b.metrics.registry.get_sample_value("fanroute_episodes_routed_skipped_total", {"record": record}) or 0.0


async def test_routed_trace_then_verdict_makes_no_episode(builder):
    b, _, episodes = builder
    await b.on_trace(routed_trace("r1"))
    await b.on_verdict(verdict_for("r1"))
    assert episodes == []
    assert (skipped(b, "trace"), skipped(b, "verdict")) == (1.0, 1.0)


async def test_verdict_before_routed_trace_makes_no_episode_and_does_not_wait_forever(builder):
    b, state, episodes = builder
    await b.on_verdict(verdict_for("r2"))
    await b.on_trace(routed_trace("r2"))
    assert episodes == [] and await state.pending("r2") == []
    assert (skipped(b, "trace"), skipped(b, "verdict")) == (1.0, 1.0)


async def test_fan_out_traces_still_become_episodes_beside_routed_ones(builder):
    b, _, episodes = builder
    await b.on_trace(routed_trace("r3"))
    await b.on_trace(judged_trace("f3"))
    for t in ("r3", "f3"):
        await b.on_verdict(verdict_for(t))
    assert [e.trace_id for e in episodes] == ["f3"]


def test_routed_traces_are_sampled_at_the_rate_only():
    traces = [routed_trace(f"r{i}", contested=True) for i in range(400)]
    assert all(sample_reason(t, 0.0) is None for t in traces)  # a contested flag does not count
    assert {sample_reason(t, 1.0) for t in traces} == {"sampled"}
    share = sum(sample_reason(t, 0.25) == "sampled" for t in traces) / len(traces)
    assert share == pytest.approx(0.25, abs=0.07)
    assert sample_reason(judged_trace("f", contested=True), 0.0) == "contested"  # fan-out unchanged
