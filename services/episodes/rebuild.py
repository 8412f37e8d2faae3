"""The episode builder's join state rebuilt from its topics after Redis lost it (FLUSHALL, a restart
without persistence).

Why: the join keeps what arrived but could not finish yet — a trace waiting for its verdict, a verdict
waiting for its trace — and each episode's first verdict and components. Lost, a waiting trace's verdict
would wait forever, a waiting verdict's trace would join nothing, and a later verdict would rebuild an
episode around itself. Everything the state held is on the topics: the traces within their TTL, every
verdict, and every episode (its primary verdict named by ``primary_reward``, its components by
``rewards``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from schemas.episode import Episode
from schemas.topics import topic
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.episodes.build import episode_id
from services.episodes.state import JoinStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rebuilt:
    """What the rebuild put back."""

    traces: int
    episodes: int
    pending: int


async def rebuild_join_state(kafka: KafkaSettings, state: JoinStore, trace_ttl_s: int) -> Rebuilt:
    """Put back every join entry the topics imply; idempotent (each write is a set-if-absent or a put)."""
    episodes: dict[str, Episode] = {}
    async for ep in read_topic(kafka, topic("episodes"), model=Episode):
        episodes[ep.episode_id] = ep  # the latest record of an episode carries all its components
    emitted = {(ep_id, c.source) for ep_id, ep in episodes.items() for c in ep.rewards}
    verdicts: dict[str, Verdict] = {}
    async for v in read_topic(kafka, topic("verdicts"), model=Verdict):
        if v.status == "ok" and v.ordering:
            verdicts.setdefault(v.verdict_id, v)
    for ep_id, ep in episodes.items():
        primary = next((c.source for c in ep.rewards if c.name == ep.primary_reward), None)
        if primary in verdicts:
            await state.set_primary(ep_id, verdicts[primary])
        for component in ep.rewards:
            await state.add_component(ep_id, component)
    n_traces = 0
    since = datetime.now(UTC) - timedelta(seconds=trace_ttl_s)
    async for trace in read_topic(kafka, topic("traces"), model=Trace, since=since):
        await state.put_trace(trace)
        n_traces += 1
    n_pending = 0
    for v in verdicts.values():
        if (episode_id(v.trace_id), v.verdict_id) in emitted:
            continue
        trace = await state.get_trace(v.trace_id)
        if trace is not None and trace.mode == "routed":
            continue  # never an episode
        # Waiting again, even beside its trace: whichever of the two records the consumer has not read
        # yet finds the other; the (episode, verdict) mark keeps the second join from publishing twice.
        if v.verdict_id not in {w.verdict_id for w in await state.pending(v.trace_id)}:
            await state.add_pending(v)
            n_pending += 1
    result = Rebuilt(n_traces, len(episodes), n_pending)
    log.info("episode builder: no join state in Redis (a first start, or Redis lost it); rebuilt from the "
             "topics (%d traces, %d episodes, %d verdicts waiting for their trace)", result.traces, result.episodes, result.pending)
    return result
