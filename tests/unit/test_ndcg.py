"""Tie-aware nDCG: equals ir-measures' nDCG without ties, and the mean over tie-breaks with them."""

from __future__ import annotations

import itertools
import random

import ir_measures
import pytest

from services.common.ndcg import format_ordering, parse_ordering, tie_aware_ndcg


def _ir_measures_ndcg(order: list[str], grades: dict[str, int], k: int) -> float:
    run = {"q": {d: float(len(order) - i) for i, d in enumerate(order)}}
    qrels = {"q": {d: g for d, g in grades.items()}}
    [m] = list(ir_measures.iter_calc([ir_measures.nDCG @ k], qrels, run))
    return m.value


@pytest.mark.parametrize("seed", range(30))
def test_without_ties_matches_ir_measures(seed):
    rng = random.Random(seed)
    names = [f"p{i}" for i in range(rng.randint(2, 7))]
    grades = {n: rng.randint(0, 3) for n in names}
    if not any(grades.values()):
        grades[names[0]] = 1
    order = names[:]
    rng.shuffle(order)
    k = rng.choice([3, 5, 10])
    assert tie_aware_ndcg([(n,) for n in order], grades, k) == pytest.approx(
        _ir_measures_ndcg(order, grades, k), abs=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_with_ties_equals_mean_over_every_tie_break(seed):
    rng = random.Random(100 + seed)
    names = [f"p{i}" for i in range(rng.randint(2, 6))]
    grades = {n: rng.randint(0, 3) for n in names}
    if not any(grades.values()):
        grades[names[0]] = 2
    rng.shuffle(names)
    tiers, i = [], 0
    while i < len(names):
        size = rng.randint(1, 3)
        tiers.append(tuple(names[i:i + size]))
        i += size
    k = rng.choice([2, 3, 10])
    breaks = [sum(perms, ()) for perms in itertools.product(*(itertools.permutations(t) for t in tiers))]
    expected = sum(_ir_measures_ndcg(list(b), grades, k) for b in breaks) / len(breaks)
    assert tie_aware_ndcg(tiers, grades, k) == pytest.approx(expected, abs=1e-9)


def test_a_tie_the_grades_cannot_resolve_is_not_punished():
    grades = {"a": 3, "b": 3, "c": 0}
    assert tie_aware_ndcg([("a", "b"), ("c",)], grades) == pytest.approx(1.0)
    assert tie_aware_ndcg([("a", "c"), ("b",)], grades) < 1.0
    assert tie_aware_ndcg([("a",)], {"a": 0, "b": 0}) == 0.0


def test_ordering_text_round_trip_and_errors():
    tiers = parse_ordering(" b = a >c ")
    assert tiers == (("b", "a"), ("c",)) and format_ordering(tiers) == "a = b > c"
    with pytest.raises(ValueError, match="unknown provider 'x'"):
        parse_ordering("a > x", names=["a", "b"])
    with pytest.raises(ValueError, match="appears twice"):
        parse_ordering("a > a")
    with pytest.raises(ValueError, match="empty tier"):
        parse_ordering("a > > b")
