"""bench/routed_eval.hedged: a router that hands the queries it is unsure of to the best single provider."""

from __future__ import annotations

from bench.routed_eval import hedged


def test_below_tau_the_fallback_answers_and_ties_go_by_name():
    probs = {"a": {"aero": 0.7, "biomed": 0.3}, "b": {"aero": 0.4, "biomed": 0.35, "web": 0.25},
             "c": {"physics": 0.5, "aero": 0.5}}
    assert hedged(probs, 0.0, "web") == {"a": "aero", "b": "aero", "c": "aero"}
    assert hedged(probs, 0.5, "web") == {"a": "aero", "b": "web", "c": "aero"}  # 0.5 is not below 0.5
    assert hedged(probs, 0.9, "web") == {"a": "web", "b": "web", "c": "web"}
