"""bench/label_rules.py: each label rule names the provider it says, and a missing demo folder is named."""

from __future__ import annotations

import asyncio

import pytest

COSTS = {"aero": 0.001, "physics": 0.0008, "libsci": 0.0008, "web-lexical": 0.003}
SCORES = {"aero": 0.70, "physics": 0.52, "libsci": 0.50, "web-lexical": 0.80}
TIERS = (("libsci", "physics", "web-lexical"), ("aero",))  # graded equal; aero a grade below


@pytest.mark.parametrize(("rule", "named"), [
    ("tier-cost-name", "libsci"),  # the label today: cheapest of the top tier, then by name
    ("tier-cost-score", "physics"),  # the same price: the judge's higher score first
    ("tier-score", "web-lexical"),  # the top tier's best score, whatever it costs
    ("score", "web-lexical"),  # the best score overall, grades ignored
])
def test_each_rule_names_its_provider(rule, named):
    from bench.label_rules import pick

    assert pick(rule, SCORES, TIERS, COSTS) == named


def test_score_ignores_the_tiers_and_an_unknown_rule_is_refused():
    from bench.label_rules import pick

    assert pick("score", {**SCORES, "aero": 0.9}, TIERS, COSTS) == "aero"
    with pytest.raises(ValueError, match="unknown rule 'best'"):
        pick("best", SCORES, TIERS, COSTS)


def test_a_folder_without_a_demo_is_named(tmp_path):
    from bench.label_rules import main, parse

    with pytest.raises(SystemExit, match=r"train/episodes.jsonl does not exist"):
        asyncio.run(main(parse(["--demo-dir", str(tmp_path)])))
