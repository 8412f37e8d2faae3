"""The label rule: which of the judge's equally graded providers a router is taught to name first.

One home for the episode builder (the student's and the linear router's labels) and the evaluation
(the judge-oracle and oracle picks), so the label ceiling is scored with the rule the labels use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Within a tier of the judge's ordering (equal grades), the cheaper provider is named first, then by name.
#: Not by this call's latency: it is measured per call and jitters by milliseconds between two runs of one
#: demo, so a latency tie-break gave two fresh runs of one commit different labels (10 % of them) and
#: different students (docs/quickstart.md, runs 20–23). A label must be a function of the judge's grades
#: and the price list only.
LABEL_RULE = "judge tiers; within a tier: cost per call ascending, then name"


def tie_key(name: str, costs: Mapping[str, float]) -> tuple[float, str]:
    """Sort key within a tier of equal grades: cost per call, then name (unknown providers last)."""
    return (costs.get(name, float("inf")), name)


def cost_aware(tiers: Sequence[Sequence[str]], costs: Mapping[str, float]) -> tuple[tuple[str, ...], ...]:
    """``tiers`` with each tier sorted by :func:`tie_key` (:data:`LABEL_RULE`)."""
    return tuple(tuple(sorted(tier, key=lambda n: tie_key(n, costs))) for tier in tiers)


def best(names: Sequence[str], scores: Mapping[str, float], costs: Mapping[str, float]) -> str:
    """The highest-scored of ``names``; ties go by :data:`LABEL_RULE` (a missing score counts 0)."""
    return min(names, key=lambda n: (-scores.get(n, 0.0), *tie_key(n, costs)))


__all__ = ["LABEL_RULE", "best", "cost_aware", "tie_key"]
