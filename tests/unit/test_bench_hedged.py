"""bench/routed_eval.hedged: a router that hands the queries it is unsure of to the best single provider."""

from __future__ import annotations

from bench.routed_eval import hedged


def test_below_tau_the_fallback_answers_and_ties_go_by_name():
    probs = {"a": {"aero": 0.7, "biomed": 0.3}, "b": {"aero": 0.4, "biomed": 0.35, "web": 0.25},
             "c": {"physics": 0.5, "aero": 0.5}}
    assert hedged(probs, 0.0, "web") == {"a": "aero", "b": "aero", "c": "aero"}
    assert hedged(probs, 0.5, "web") == {"a": "aero", "b": "web", "c": "aero"}  # 0.5 is not below 0.5
    assert hedged(probs, 0.9, "web") == {"a": "web", "b": "web", "c": "web"}


def test_bad_hedge_values_are_refused_before_any_work(capsys):
    import pytest

    from bench.sft_recipes import main

    for junk in ("0.5,x", "1.5"):
        with pytest.raises(SystemExit):
            main(["--episodes", "/nonexistent.jsonl", "--traces", "/nonexistent.jsonl", "--hedge", junk])
        assert "--hedge" in capsys.readouterr().err
