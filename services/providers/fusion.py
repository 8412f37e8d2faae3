"""Reciprocal-rank fusion of the candidates' citations into one list for the caller."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.trace import Candidate


class FusedResult(BaseModel):
    """One fused result and which providers cited it, at which rank."""

    model_config = ConfigDict(frozen=True)
    url: str
    title: str
    snippet: str
    score: float = Field(description="RRF score: sum over providers of 1 / (k + rank)")
    providers: dict[str, int] = Field(description="Provider name -> the rank it gave this result")


def rrf(candidates: tuple[Candidate, ...] | list[Candidate], *, k: int = 60, limit: int = 10) -> list[FusedResult]:
    """Fuse every answering candidate's ranking; ties break by URL so the output is deterministic."""
    scores: dict[str, float] = {}
    ranks: dict[str, dict[str, int]] = {}
    first = {}
    for cand in candidates:
        for cit in cand.citations:
            scores[cit.url] = scores.get(cit.url, 0.0) + 1.0 / (k + cit.rank)
            ranks.setdefault(cit.url, {})[cand.provider] = cit.rank
            first.setdefault(cit.url, cit)
    order = sorted(scores, key=lambda u: (-scores[u], u))[:limit]
    # built without re-validation: every value comes from an already validated citation
    return [FusedResult.model_construct(url=u, title=first[u].title, snippet=first[u].snippet,
                                        score=round(scores[u], 8), providers=ranks[u]) for u in order]
