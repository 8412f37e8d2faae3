"""Selection-time signals: how much the providers' citations agree.

Overlap is the Jaccard index of the cited URL sets of each pair of providers that answered.
Where fewer than two answered there is nothing to disagree about: overlap is vacuously 1.0 and
the trace is not contested (the failures themselves are on the candidates).
"""

from __future__ import annotations

from itertools import combinations

from schemas.trace import Candidate, Signals


def jaccard(a: set[str], b: set[str]) -> float:
    """|a ∩ b| / |a ∪ b|, with two empty sets counting as full agreement."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def compute_signals(candidates: tuple[Candidate, ...] | list[Candidate], threshold: float) -> Signals:
    """Pairwise overlap, its mean and min, and ``contested`` = mean overlap below ``threshold``."""
    ok = sorted((c for c in candidates if c.ok), key=lambda c: c.provider)
    urls = {c.provider: {cit.url for cit in c.citations} for c in ok}
    pairwise = {f"{a}|{b}": round(jaccard(urls[a], urls[b]), 6)
                for a, b in combinations([c.provider for c in ok], 2)}
    values = list(pairwise.values())
    mean = sum(values) / len(values) if values else 1.0
    return Signals(
        pairwise_overlap=pairwise,
        mean_overlap=round(mean, 6),
        min_overlap=min(values) if values else 1.0,
        contested=bool(values) and mean < threshold,
        contested_threshold=threshold,
        providers_ok=len(ok),
        providers_failed=len(candidates) - len(ok),
    )
