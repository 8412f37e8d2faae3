"""The best single provider, chosen on the TRAINING episodes only (never on held-out data).

Rule: the provider the judge put in its top tier in the largest share of training episodes
(episodes whose system turn lists it); ties go to the lower mean position, a tied tier counting as
the mean of the positions it covers (``a = b > c``: a and b at 0.5, c at 2), then to the name.
The training episodes carry the judge's ordering as the assistant turn, not its grades, so the
rule reads orderings only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from schemas.episode import Episode
from services.common.errors import FanrouteError
from services.common.ndcg import parse_ordering
from services.common.prompt import providers_of

RULE = ("highest share of training episodes with the provider in the judge's top tier; ties by lower mean "
        "tie-aware position (a tied tier counts as the mean of the positions it covers), then by name")


class NoBaseline(FanrouteError, ValueError):
    """No training episode has a readable ordering, so no provider can be chosen."""


class ProviderRecord(BaseModel):
    """How one provider fared in the training episodes' orderings."""

    model_config = ConfigDict(frozen=True)
    provider: str
    episodes: int = Field(description="Training episodes whose provider set includes it")
    top_share: float = Field(description="Share of those with the provider in the judge's top tier")
    mean_position: float = Field(description="Mean tie-aware 0-based position (absent from the ordering = last)")


class BestSingle(BaseModel):
    """The chosen provider, the rule, and every provider's record (best first)."""

    model_config = ConfigDict(frozen=True)
    provider: str
    rule: str = RULE
    episodes_used: int
    episodes_unreadable: int = Field(description="Episodes whose assistant turn is not an ordering of its providers")
    table: tuple[ProviderRecord, ...]


def _positions(tiers: Sequence[Sequence[str]]) -> dict[str, float]:
    """Each name's mean 0-based position, a tier sharing the positions it covers."""
    out, pos = {}, 0
    for tier in tiers:
        for name in tier:
            out[name] = pos + (len(tier) - 1) / 2
        pos += len(tier)
    return out


def choose_best_single(episodes: Sequence[Episode]) -> BestSingle:
    """The best single provider by :data:`RULE`; :class:`NoBaseline` when no episode can be read."""
    tops: dict[str, int] = defaultdict(int)
    positions: dict[str, list[float]] = defaultdict(list)
    used = unreadable = 0
    for ep in episodes:
        answer = next((m.content for m in ep.messages if m.role == "assistant"), None)
        names = providers_of(ep)
        try:
            tiers = parse_ordering(answer or "", names or None)
        except ValueError:
            unreadable += 1
            continue
        listed = names or tuple(n for t in tiers for n in t)
        pos = _positions(tiers)
        used += 1
        for name in listed:
            tops[name] += name in tiers[0]
            positions[name].append(pos.get(name, float(len(listed) - 1)))
    if not used:
        raise NoBaseline(f"none of {len(episodes)} training episodes has an ordering to choose a best single "
                         "provider from")
    table = sorted((ProviderRecord(provider=p, episodes=len(v), top_share=round(tops[p] / len(v), 6),
                                   mean_position=round(sum(v) / len(v), 6)) for p, v in positions.items()),
                   key=lambda r: (-r.top_share, r.mean_position, r.provider))
    return BestSingle(provider=table[0].provider, episodes_used=used, episodes_unreadable=unreadable,
                      table=tuple(table))
