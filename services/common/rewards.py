"""Named reward components of a replay rollout beyond the verifier's nDCG: the cost-aware ``ndcg_cost``.

Why here: the gateway decides by P(best) − λ · cost per call, and RL should be able to learn the same
trade-off — the cheaper route where quality ties — so λ has one default for both
(:data:`DEFAULT_COST_WEIGHT`), and the rollout runner computes the component from what it already holds:
the verifier's nDCG, the answer, and the task's recorded candidates (``tests/fixtures/candidates.json``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from services.common.ndcg import parse_ordering

#: λ of the gateway's routing decision and of the ``ndcg_cost`` reward: 0 = quality only
DEFAULT_COST_WEIGHT = 0.0
RewardComponent = Literal["ndcg", "ndcg_cost"]
REWARD_COMPONENTS: tuple[str, ...] = ("ndcg", "ndcg_cost")
CANDIDATES_FILE = "tests/fixtures/candidates.json"


class TaskCostsError(ValueError):
    """A task whose recorded candidates carry no usable cost per call."""


def task_costs(files: Mapping[str, str]) -> dict[str, float]:
    """Cost per call (USD) of each provider, from the task's recorded candidates."""
    try:
        rows = json.loads(files[CANDIDATES_FILE])
        costs = {str(r["provider"]): float(r["cost_usd"]) for r in rows}
    except KeyError as exc:
        raise TaskCostsError(f"the task has no {CANDIDATES_FILE} with provider and cost_usd ({exc})") from None
    except (TypeError, ValueError) as exc:
        raise TaskCostsError(f"{CANDIDATES_FILE} is not a list of candidates with cost_usd: {exc}") from None
    if not costs or any(c < 0 for c in costs.values()):
        raise TaskCostsError(f"{CANDIDATES_FILE} holds no provider, or a negative cost")
    return costs


def first_choice(answer: str | None, costs: Mapping[str, float]) -> str | None:
    """The provider an ordering sends a query to: the cheapest of its first tier (the gateway's rule); None
    when the answer does not parse."""
    if not answer:
        return None
    try:
        tiers = parse_ordering(answer, sorted(costs))
    except ValueError:
        return None
    return min(tiers[0], key=lambda n: (costs[n], n)) if tiers and tiers[0] else None


def cost_aware(ndcg: float, answer: str | None, costs: Mapping[str, float], cost_weight: float) -> dict[str, float]:
    """``{"ndcg", "first_cost_usd", "ndcg_cost"}`` with ``ndcg_cost = ndcg − λ · cost of the first choice``.

    An answer that does not parse is charged the dearest provider's cost, so not answering is never
    cheaper than answering."""
    chosen = first_choice(answer, costs)
    cost = costs[chosen] if chosen is not None else max(costs.values())
    return {"ndcg": ndcg, "first_cost_usd": cost, "ndcg_cost": ndcg - cost_weight * cost}


__all__ = ["CANDIDATES_FILE", "DEFAULT_COST_WEIGHT", "REWARD_COMPONENTS", "RewardComponent", "TaskCostsError",
           "cost_aware", "first_choice", "task_costs"]
