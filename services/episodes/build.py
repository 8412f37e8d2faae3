"""A judged trace as a query-only episode: the conversation and its named reward components."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from schemas.base import content_id
from schemas.episode import ChatMessage, Episode, RewardComponent
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.labels import LABEL_RULE, cost_aware
from services.common.ndcg import format_ordering, tie_aware_ndcg
from services.common.prompt import reward_name, router_turns


def episode_id(trace_id: str) -> str:
    """One episode per trace: later verdicts add reward components to it."""
    return content_id("episode", trace_id)


def ndcg_component(ep_id: str, verdict: Verdict, tiers: tuple[tuple[str, ...], ...]) -> RewardComponent:
    """Tie-aware nDCG of ``tiers`` against this verdict's grades, named after judge and rubric."""
    grades = {g.provider: float(g.grade) for g in verdict.grades}
    name = reward_name(verdict.judge_model, verdict.rubric_hash)
    return RewardComponent(component_id=content_id(ep_id, name), name=name,
                           value=round(tie_aware_ndcg(tiers, grades), 6), source=verdict.verdict_id)


def build_episode(trace: Trace, verdict: Verdict, components: Iterable[RewardComponent] = (),
                  *, now: datetime | None = None) -> Episode:
    """The episode of ``trace``: its assistant turn is ``verdict``'s ordering; rewards = components."""
    if verdict.status != "ok" or not verdict.ordering:
        raise ValueError(f"verdict {verdict.verdict_id} has no ordering (status {verdict.status})")
    ep_id = episode_id(trace.trace_id)
    rewards = {c.name: c for c in components}
    own = ndcg_component(ep_id, verdict, verdict.ordering)
    rewards.setdefault(own.name, own)
    # within a tier the cheaper provider first (LABEL_RULE): a router that learns "first name" learns the
    # cheaper route wherever quality is equal
    ordering = cost_aware(verdict.ordering, {c.provider: c.cost_usd for c in trace.candidates})
    return Episode(
        episode_id=ep_id, trace_id=trace.trace_id, created_at=now or datetime.now(UTC),
        messages=(*router_turns((c.provider for c in trace.candidates), trace.query),
                  ChatMessage(role="assistant", content=format_ordering(ordering, keep_tier_order=True))),
        rewards=tuple(sorted(rewards.values(), key=lambda c: c.name)), primary_reward=own.name,
        label_rule=LABEL_RULE)
