"""The linear router: fitted on episodes' queries and first choices, scores as log-probabilities,
decides like the scoring router, refuses data it cannot learn from."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from schemas.episode import ChatMessage, Episode
from services.common.prompt import router_turns
from services.router import linear

PROVIDERS = ("aero", "biomed", "web")
TOPICS = {
    "aero": ["supersonic wing flow", "boundary layer over an airfoil", "shock wave at mach two",
             "heat transfer in hypersonic flight", "wing flutter and buckling"],
    "biomed": ["protein in heart cells", "blood pressure of patients", "mouse model of tumour growth",
               "enzyme activity in liver", "clinical trial of a drug"],
}


def _episode(i: int, query: str, answer: str) -> Episode:
    return Episode(episode_id=f"ep{i:04d}", trace_id=f"t{i:04d}", created_at=datetime.now(UTC),
                   messages=(*router_turns(PROVIDERS, query), ChatMessage(role="assistant", content=answer)),
                   rewards=(), primary_reward=None, label_rule="test")


def _episodes(n_per: int = 6) -> list[Episode]:
    out = []
    for label, queries in TOPICS.items():
        for k in range(n_per):
            q = f"{queries[k % len(queries)]} study {k}"
            out.append(_episode(len(out), q, f"{label} > web = {'biomed' if label == 'aero' else 'aero'}"))
    return out


def test_it_learns_the_first_choice_and_scores_log_probabilities() -> None:
    router = linear.fit(_episodes(), seed=0)
    assert router.labels == {"aero": 6, "biomed": 6}
    assert router.c in linear.C_GRID and 0.0 <= router.cv_accuracy <= 1.0
    scores = router.scores("shock wave over a supersonic wing", PROVIDERS)
    assert set(scores) == set(PROVIDERS) and scores["aero"] > scores["biomed"]
    assert scores["web"] == linear.UNSEEN_LOGPROB  # never a label: listed, never preferred
    assert math.isclose(sum(math.exp(v) for k, v in scores.items() if k != "web"), 1.0, rel_tol=1e-6)
    ordering, _, ms = linear.decide_timed(router, "protein activity in patients' blood", PROVIDERS,
                                          {"aero": 0.001, "biomed": 0.001, "web": 0.003}, 0.0)
    assert ordering[0] == "biomed" and set(ordering) == set(PROVIDERS) and ms > 0


def test_the_same_episodes_in_another_order_fit_the_same_router() -> None:
    """Episodes arrive in the order of their (random) ids; the cross-validation folds must not follow it."""
    import random

    eps = _episodes(n_per=10)
    shuffled = eps[:]
    random.Random(7).shuffle(shuffled)
    a, b = linear.fit(eps, seed=0), linear.fit(shuffled, seed=0)
    assert (a.c, a.cv_accuracy) == (b.c, b.cv_accuracy)
    for q in ("supersonic flow over a wing", "enzyme in heart cells", "a study of both"):
        assert a.scores(q, PROVIDERS) == b.scores(q, PROVIDERS)


def test_cost_weight_moves_the_decision_like_the_scoring_router() -> None:
    router = linear.fit(_episodes(), seed=0)
    q = "wing"  # weak evidence: the two labels are close
    costs = {"aero": 0.010, "biomed": 0.0001, "web": 0.003}
    free, _, _ = linear.decide_timed(router, q, PROVIDERS, costs, 0.0)
    dear, _, _ = linear.decide_timed(router, q, PROVIDERS, costs, 1e4)
    assert dear[0] == "biomed" and (free[0] == "aero" or free == dear)


def test_first_choice_reads_the_ordering() -> None:
    assert linear.first_choice(_episode(0, "q", "biomed = aero > web")) == "biomed"
    assert linear.first_choice(_episode(1, "q", "")) is None


def test_too_little_to_learn_from_is_refused() -> None:
    with pytest.raises(linear.LinearRouterError, match="too few"):
        linear.fit(_episodes()[:5])
    same = [_episode(i, f"query {i}", "aero > web") for i in range(12)]
    with pytest.raises(linear.LinearRouterError, match="nothing to learn"):
        linear.fit(same)


def test_the_artifact_round_trips_without_pickle(tmp_path) -> None:
    """JSON out, JSON in: the same probabilities on any query; a damaged artifact names what is wrong."""
    import json

    router = linear.fit(_episodes(), seed=0)
    path = tmp_path / linear.ARTIFACT_FILE
    path.write_text(json.dumps(linear.to_artifact(router)))
    back = linear.from_artifact(json.loads(path.read_text()))
    for q in ("supersonic wing", "protein in mouse heart", "nothing in common at all", ""):
        a, b = router.scores(q, PROVIDERS), back.scores(q, PROVIDERS)
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-9 for k in a)
    assert back.labels == router.labels and back.c == router.c
    bad = json.loads(path.read_text())
    bad["coef"] = bad["coef"][:-1] if len(bad["coef"]) > 1 else [bad["coef"][0][:-1]]
    with pytest.raises(linear.LinearRouterError, match="coef does not match"):
        linear.from_artifact(bad)
    with pytest.raises(linear.LinearRouterError, match="not a version-1"):
        linear.from_artifact({"format": "something else"})
    with pytest.raises(linear.LinearRouterError, match="malformed"):
        linear.from_artifact({"format": "fanroute-linear-router", "version": 1})


def test_a_label_seen_once_does_not_switch_cross_validation_off() -> None:
    eps = _episodes() + [_episode(99, "a web only question", "web > aero = biomed")]
    router = linear.fit(eps, seed=0)
    assert router.labels["web"] == 1 and not math.isnan(router.cv_accuracy) and router.c in linear.C_GRID


@pytest.mark.parametrize("labels", [("aero", "biomed"), ("aero", "biomed", "web")])
def test_the_compiled_scorer_is_the_pipelines_predict_proba(labels, tmp_path) -> None:
    """Two classes (one coefficient row, a logistic) and three (a softmax), fitted and from the artifact;
    queries with unknown n-grams only, none at all, accents, repeats."""
    import numpy as np

    eps = _episodes()
    if "web" in labels:
        eps += [_episode(100 + k, f"general news item {k}", "web > aero = biomed") for k in range(6)]
    fitted = linear.fit(eps, seed=0)
    assert fitted.classes == labels
    loaded = linear.from_artifact(linear.to_artifact(fitted))
    queries = ["shock wave over a supersonic wing", "", "   ", "qqqq zzzz", "Ωμέγα ünïcode wïng",
               "wing wing wing wing flow", "protein in heart cells study 3", "general news"]
    for router in (fitted, loaded):
        compiled = linear.CompiledScorer(router.pipeline)
        for q in queries:
            want = router.pipeline.predict_proba([q])[0]
            assert np.allclose(compiled.proba(q), want, rtol=0, atol=1e-12), q
            got = router.scores(q, labels)
            assert all(math.isclose(got[c], math.log(p), abs_tol=1e-9) for c, p in zip(router.classes, want))


def test_the_compiled_scorer_refuses_a_vectorizer_it_does_not_compute() -> None:
    router = linear.fit(_episodes(), seed=0)
    router.pipeline.steps[0][1].transformer_list[0][1].set_params(norm="l1")
    with pytest.raises(linear.LinearRouterError, match="norm='l1'"):
        linear.CompiledScorer(router.pipeline)
