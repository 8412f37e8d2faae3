"""Tie-aware nDCG of a tiered ordering against graded labels (McSherry & Najork, ECIR 2008).

Items tied in one tier share the average discount of the positions the tier covers, which is the
expected nDCG over every way of breaking the tie: a tie the grades cannot resolve is never punished
or rewarded. Linear gain (gain = grade) and a log2 discount, as trec_eval's ndcg. This module is
also copied verbatim into every replay task (tests/score.py), so it imports nothing outside the
standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def _discount(position: int) -> float:
    """Discount of a 0-based position."""
    return 1.0 / math.log2(position + 2)


def tiered_dcg(tiers: Sequence[Sequence[str]], grades: Mapping[str, float], k: int | None = None) -> float:
    """DCG@k where each tier's items share their positions' mean discount (cut at k)."""
    total, pos = 0.0, 0
    limit = k if k is not None else sum(len(t) for t in tiers)
    for tier in tiers:
        n = len(tier)
        if n == 0:
            continue
        covered = [p for p in range(pos, pos + n) if p < limit]
        if covered:
            # Each item lands in each of the n positions with equal chance; positions past k add 0.
            mean_discount = sum(_discount(p) for p in covered) / n
            total += mean_discount * sum(grades.get(item, 0.0) for item in tier)
        pos += n
    return total


def tie_aware_ndcg(tiers: Sequence[Sequence[str]], grades: Mapping[str, float], k: int | None = None) -> float:
    """nDCG@k of ``tiers`` (best first) against ``grades``; 0 when nothing has positive grade.

    Items missing from ``tiers`` count as ranked after everything (gain lost); unknown items gain 0.
    """
    ideal_order = sorted((g for g in grades.values() if g > 0), reverse=True)
    limit = k if k is not None else len(grades)
    ideal = sum(g * _discount(i) for i, g in enumerate(ideal_order[:limit]))
    if ideal <= 0:
        return 0.0
    return tiered_dcg(tiers, grades, k) / ideal


def parse_ordering(text: str, names: Sequence[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """Tiers from ``"a = b > c"``: ``>`` separates tiers (best first), ``=`` ties within one.

    With ``names``, an unknown or repeated name is a ValueError naming it.
    """
    tiers = []
    seen: set[str] = set()
    for chunk in text.strip().split(">"):
        tier = tuple(n.strip() for n in chunk.split("=") if n.strip())
        if not tier:
            raise ValueError(f"empty tier in ordering {text!r}")
        for name in tier:
            if names is not None and name not in names:
                raise ValueError(f"unknown provider {name!r} in ordering {text!r}")
            if name in seen:
                raise ValueError(f"provider {name!r} appears twice in ordering {text!r}")
            seen.add(name)
        tiers.append(tier)
    return tuple(tiers)


def format_ordering(tiers: Sequence[Sequence[str]], *, keep_tier_order: bool = False) -> str:
    """The one written form of an ordering: ``"a = b > c"``, names sorted within a tier unless
    ``keep_tier_order`` (a label whose within-tier order carries a rule, e.g. cheaper first)."""
    return " > ".join(" = ".join(t if keep_tier_order else sorted(t)) for t in tiers if t)
