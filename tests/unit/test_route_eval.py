"""The trainer's routing evaluation: names scored as the router scores them, the pick graded."""

from __future__ import annotations

import math

import pytest

from services.trainer.route_eval import name_scores, route_evaluate, route_items
from tests.support.records import episode
from tests.support.tiny_model import build_tiny_model

PROVIDERS = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(tmp_path_factory.mktemp("tiny") / "base")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(base).eval(), AutoTokenizer.from_pretrained(base)


def _items(tok, n: int = 6):
    eps = [episode(f"query {i} about cells", "beta > alpha = gamma", PROVIDERS, ep_id=f"e{i}") for i in range(n)]
    grades = [{"beta": 3.0, "alpha": 1.0, "gamma": 1.0}] * n
    return route_items(tok, eps, grades, [PROVIDERS] * n)


def test_a_name_score_is_its_tokens_logprob_after_the_shared_prefix(tiny) -> None:
    """Batched with padding, the score equals the same sum from each sequence on its own."""
    import torch

    model, tok = tiny
    item = _items(tok, 1)[0]
    assert item.label == "beta" and 0 < item.shared < min(len(s) for s in item.sequences)
    batched = name_scores(model, item, tok.pad_token_id)
    for name, seq in zip(item.providers, item.sequences, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits.float(), dim=-1)[0]
        alone = math.fsum(float(logp[t - 1, seq[t]]) for t in range(item.shared, len(seq)))
        assert batched[name] == pytest.approx(alone, abs=1e-4)


def test_the_figures(tiny) -> None:
    model, tok = tiny
    items = _items(tok)
    out = route_evaluate(model, items, tok.pad_token_id)
    assert out["test/route_n"] == 6
    shares = {k: v for k, v in out.items() if k.startswith("test/route_share/")}
    assert math.isclose(sum(shares.values()), 1.0) and set(shares) <= {f"test/route_share/{p}" for p in PROVIDERS}
    picked_beta = shares.get("test/route_share/beta", 0.0)
    assert out["test/route_agree"] == pytest.approx(picked_beta) and out["test/route_best"] == pytest.approx(picked_beta)
    assert out["test/route_grade"] == pytest.approx(3.0 * picked_beta + 1.0 * (1 - picked_beta))
    assert route_evaluate(model, [], tok.pad_token_id) == {}


def test_the_decision_is_the_gateways_with_its_table_and_its_price(tiny) -> None:
    """A table that puts the dearest provider in every label's top tier sends every pick there at λ = 0;
    a λ that prices it out sends every pick back to a cheaper one; the mean cost is reported."""
    model, tok = tiny
    items = _items(tok)
    dear = PROVIDERS[-1]
    rates = {p: {p: 1.0, dear: 1.0} for p in PROVIDERS}
    costs = {p: (1.0 if p == dear else 0.001) for p in PROVIDERS}
    free = route_evaluate(model, items, tok.pad_token_id, rates, costs, 0.0)
    assert free[f"test/route_share/{dear}"] == 1.0 and free["test/route_cost"] == pytest.approx(1.0)
    priced = route_evaluate(model, items, tok.pad_token_id, rates, costs, 10.0)
    assert f"test/route_share/{dear}" not in priced and priced["test/route_cost"] == pytest.approx(0.001)
