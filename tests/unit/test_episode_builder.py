"""The episode builder on the in-memory bus: joins in either order, idempotent, additive rewards."""

from __future__ import annotations

import pytest

from schemas import Episode, Task, topic
from services.common.bus import Bus
from services.common.idempotency import MemoryKeyStore
from services.common.ndcg import parse_ordering
from services.common.prompt import system_prompt
from services.common.settings import KafkaSettings
from services.episodes.build import episode_id
from services.episodes.state import MemoryJoinStore
from services.episodes.worker import EpisodeBuilder
from tests.support.records import judged_trace, verdict_for


@pytest.fixture
async def builder():
    bus = Bus(KafkaSettings(bootstrap_servers="memory://"))
    episodes: list[Episode] = []
    tasks: list[Task] = []

    async def on_ep(e: Episode) -> None:
        episodes.append(e)

    async def on_task(t: Task) -> None:
        tasks.append(t)

    bus.subscribe(topic("episodes"), on_ep, group_id="t")
    bus.subscribe(topic("tasks"), on_task, group_id="t")
    await bus.start()
    yield EpisodeBuilder(bus, MemoryJoinStore(), MemoryKeyStore()), episodes, tasks
    await bus.stop()


async def test_trace_then_verdict_makes_a_query_only_episode_and_a_task(builder):
    b, episodes, tasks = builder
    t = judged_trace("t1")
    await b.on_trace(t)
    assert episodes == []
    await b.on_verdict(verdict_for("t1"))
    [ep] = episodes
    assert ep.episode_id == episode_id("t1") and ep.trace_id == "t1"
    system, user, assistant = ep.messages
    assert system.content == system_prompt(["bm25-all", "dense-all", "eng-bm25", "lib-bm25"])
    assert "excellent" not in system.content and user.content == t.query  # names only, no answers
    assert parse_ordering(assistant.content) == (("bm25-all", "eng-bm25"), ("dense-all",), ("lib-bm25",))
    [reward] = ep.rewards
    assert reward.name == "ndcg:judge-a:rubric-1" and reward.value == 1.0
    assert len(tasks) == 1 and tasks[0].trace_id == "t1"


async def test_verdict_before_trace_joins_when_the_trace_arrives(builder):
    b, episodes, _ = builder
    await b.on_verdict(verdict_for("t2"))
    assert episodes == []
    await b.on_trace(judged_trace("t2"))
    assert [e.trace_id for e in episodes] == ["t2"]


async def test_replays_produce_nothing_new_and_a_new_rubric_adds_a_component(builder):
    b, episodes, tasks = builder
    await b.on_trace(judged_trace("t3"))
    await b.on_verdict(verdict_for("t3"))
    await b.on_verdict(verdict_for("t3"))
    await b.on_trace(judged_trace("t3"))
    assert len(episodes) == 1 and len(tasks) == 1
    await b.on_verdict(verdict_for("t3", rubric="rubric-2", grades={"bm25-all": 0, "dense-all": 3,
                                                                   "eng-bm25": 1, "lib-bm25": 0}))
    first, second = episodes
    assert second.messages == first.messages  # the first verdict's ordering stays the answer
    rewards = {c.name: c.value for c in second.rewards}
    assert rewards["ndcg:judge-a:rubric-1"] == 1.0
    assert 0 < rewards["ndcg:judge-a:rubric-2"] < 1.0  # scored against the new grades, beside the old
    assert {c.component_id for c in first.rewards} < {c.component_id for c in second.rewards}
    # the primary reward stays the first verdict's, whatever the names sort like
    assert first.primary_reward == second.primary_reward == "ndcg:judge-a:rubric-1"


async def test_failed_verdicts_are_skipped(builder):
    b, episodes, _ = builder
    await b.on_trace(judged_trace("t4"))
    await b.on_verdict(verdict_for("t4", status="failed"))
    assert episodes == [] and b.metrics.skipped._value.get() == 1


async def test_a_verdict_no_replay_could_score_still_makes_an_episode_but_no_task(builder):
    b, episodes, tasks = builder
    await b.on_trace(judged_trace("t5"))
    await b.on_verdict(verdict_for("t5", grades={"bm25-all": 0, "dense-all": 0, "eng-bm25": 0, "lib-bm25": 0}))
    assert len(episodes) == 1 and tasks == [] and b.metrics.no_task._value.get() == 1


def test_equal_grades_teach_the_cheaper_provider_first_then_by_name_never_by_latency():
    from services.episodes.build import LABEL_RULE, build_episode

    t = judged_trace("t-cost")
    priced = {"bm25-all": (0.003, 100.0), "eng-bm25": (0.001, 300.0), "dense-all": (0.001, 50.0),
              "lib-bm25": (0.0, 10.0)}
    t = t.model_copy(update={"candidates": tuple(
        c.model_copy(update={"cost_usd": priced[c.provider][0], "latency_ms": priced[c.provider][1]})
        for c in t.candidates)})
    grades = {"bm25-all": 3, "eng-bm25": 3, "dense-all": 1, "lib-bm25": 1}
    ep = build_episode(t, verdict_for(t.trace_id, grades=grades))
    # the judge tied bm25-all and eng-bm25: the cheaper one is named first; lib-bm25 ties dense-all
    # and is cheaper still; equal cost falls to the name
    assert parse_ordering(ep.messages[2].content) == (("eng-bm25", "bm25-all"), ("lib-bm25", "dense-all"))
    assert ep.label_rule == LABEL_RULE and "cost" in ep.label_rule
    same_cost = t.model_copy(update={"candidates": tuple(c.model_copy(update={"cost_usd": 0.001})
                                                         for c in t.candidates)})
    ep2 = build_episode(same_cost, verdict_for(t.trace_id, grades=grades))
    assert parse_ordering(ep2.messages[2].content)[0] == ("bm25-all", "eng-bm25")  # by name
    # the measured latency jitters between two runs of one demo: it must not move the label
    for slow in ("bm25-all", "eng-bm25"):
        jittered = same_cost.model_copy(update={"candidates": tuple(
            c.model_copy(update={"latency_ms": 5_000.0 if c.provider == slow else 1.0}) for c in same_cost.candidates)})
        ep3 = build_episode(jittered, verdict_for(t.trace_id, grades=grades))
        assert ep3.messages[2].content == ep2.messages[2].content
    assert ep2.rewards == ep.rewards  # the reward is the judge's, whatever the label order within a tier
