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


def test_label_ndcg_scores_the_provider_the_label_names_under_given_cut_points():
    from bench.label_rules import label_ndcg

    # (names, lexical, cosine) and each provider's nDCG; web-lexical failed (-1: graded 0 by rule)
    rows = [((("aero", "libsci", "web-lexical"), [0.5, 0.5, -1.0], [0.6, 0.3, -1.0]),
             {"aero": 0.8, "libsci": 0.2, "web-lexical": 1.0})]
    # w = 1: cosine only. Cut at 0.25/0.5/0.7: aero grade 2, libsci 1 -> aero is the label
    assert label_ndcg(rows, 1.0, (0.25, 0.5, 0.7), COSTS) == pytest.approx(0.8)
    # cut at 0.2/0.25/0.9: both grade 2, a tie: libsci is cheaper -> libsci
    assert label_ndcg(rows, 1.0, (0.2, 0.25, 0.9), COSTS) == pytest.approx(0.2)


def test_folds_are_fixed_by_the_query_id_and_salt():
    import hashlib

    from bench.label_rules import fold_of

    assert fold_of("cacm/1", 0) == hashlib.sha256(b"cacm/1").digest()[0] % 2
    ids = [f"cacm/{i}" for i in range(200)]
    assert [fold_of(q, 1) for q in ids] == [fold_of(q, 1) for q in ids]
    assert [fold_of(q, 1) for q in ids] != [fold_of(q, 2) for q in ids]
    assert 60 < sum(fold_of(q, 3) for q in ids) < 140


def test_fold_salts_that_are_not_integers_are_refused_naming_the_flag(capsys):
    from bench.label_rules import parse

    assert parse(["--fold-salts", "0,3"]).fold_salts == (0, 3)
    with pytest.raises(SystemExit):
        parse(["--fold-salts", "0,x"])
    assert "--fold-salts" in capsys.readouterr().err
