"""The scoring router: the vLLM-shaped request, reading candidate scores back from ``prompt_logprobs``,
the decision by P(best) − λ · cost, and the gateway routing with it against a local server that
speaks vLLM's completions response shape."""

from __future__ import annotations

import math

import pytest

from services.common.prompt import render_chatml, router_messages
from services.router.client import RouterClient, RouterUnparseable
from services.router.scoring import ScoresUnreadable, decide, parse_scores, probabilities, score_request, utilities
from tests.support.http_fake import Reply, ScriptedServer, scored_completion, started
from tests.unit.test_gateway_routed import make, router  # noqa: F401  (the routed gateway fixtures)

COMPLETIONS = "/v1/completions"
PROVIDERS = ("a", "b", "c")


def choice(ids: list[int], logprobs: list[float], index: int = 0) -> dict:
    """One vLLM completion choice whose prompt tokens are ``ids`` with these logprobs (after the first)."""
    return {"index": index, "text": "x", "prompt_logprobs": [None, *(
        {str(t): {"logprob": lp, "rank": 3, "decoded_token": "t"}} for t, lp in zip(ids[1:], logprobs, strict=True))]}


def test_the_request_is_one_completions_call_with_a_prompt_per_provider():
    body = score_request("router@3", PROVIDERS, "heat transfer")
    prefix = render_chatml(router_messages(PROVIDERS, "heat transfer"))
    assert body == {"model": "router@3", "prompt": [prefix + n for n in PROVIDERS], "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": 0}
    assert prefix.endswith("<|im_start|>user\nheat transfer<|im_end|>\n<|im_start|>assistant\n")


def test_render_chatml_is_the_students_chat_template():
    """The text the scoring router sends is what the sampler's chat template renders for the same turns."""
    from tests.support.tiny_model import build_tokenizer

    msgs = router_messages(("web-lexical", "aero", "biomed"), "boundary layer on a flat plate?")
    tok = build_tokenizer()
    assert render_chatml(msgs) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert render_chatml(msgs, add_generation_prompt=False) == tok.apply_chat_template(msgs, tokenize=False)


def test_scores_sum_the_tokens_after_the_shared_prefix():
    # prompts: [1 2 3] + name tokens; "web-lex" and "web-sem" share the name token 50 ("web-"), which is
    # dropped like the prompt (it adds the same to both), so only their last tokens count.
    body = {"choices": [
        choice([1, 2, 3, 40], [-0.1, -0.2, -2.0], index=0),              # aero: -2.0
        choice([1, 2, 3, 50, 61], [-0.1, -0.2, -0.7, -0.3], index=1),   # web-lex: -0.7 - 0.3
        choice([1, 2, 3, 50, 62], [-0.1, -0.2, -0.7, -1.5], index=2),   # web-sem: -0.7 - 1.5
    ]}
    scores = parse_scores(body, ("aero", "web-lex", "web-sem"))
    assert scores == pytest.approx({"aero": -2.0, "web-lex": -1.0, "web-sem": -2.2})
    reversed_body = {"choices": list(reversed(body["choices"]))}  # matched by index, not by position
    assert parse_scores(reversed_body, ("aero", "web-lex", "web-sem")) == scores


def test_two_names_sharing_a_prefix_only_count_where_they_differ():
    body = {"choices": [choice([1, 2, 50, 61], [-0.1, -0.9, -0.3], 0), choice([1, 2, 50, 62], [-0.1, -0.9, -1.5], 1)]}
    assert parse_scores(body, ("web-lex", "web-sem")) == pytest.approx({"web-lex": -0.3, "web-sem": -1.5})


@pytest.mark.parametrize(("body", "why"), [
    ({"choices": [choice([1, 2], [-1.0])]}, "expected 3 choices, got 1"),
    ({"choices": "no"}, "expected 3 choices, got str"),
    ({"choices": [choice([1, 2], [-1.0], i) for i in (0, 1, 1)]}, "do not cover"),
    ({"choices": [{"index": i, "prompt_logprobs": None} for i in range(3)]}, "prompt_logprobs missing"),
    ({"choices": [{"index": i, "prompt_logprobs": [None, {"5": {"logprob": -1}, "6": {"logprob": -2}}]}
                  for i in range(3)]}, "one entry per position"),
    ({"choices": [choice([1, 2, 3], [-1.0, -0.5], i) for i in range(3)]}, "same sequence"),
])
def test_a_reply_without_usable_scores_is_refused_with_the_reason(body, why):
    with pytest.raises(ScoresUnreadable, match=why):
        parse_scores(body, PROVIDERS)


def test_the_decision_weighs_probability_against_cost():
    scores = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)}
    cost = {"a": 0.004, "b": 0.001, "c": 0.001}
    assert probabilities(scores) == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
    assert decide(scores, cost, 0.0) == ("a", "b", "c")  # λ = 0: pure quality
    # λ = 100 per USD: a costs 0.4 of probability, b and c 0.1 → b (0.2) > c (0.1) > a (0.1, dearer)
    assert utilities(probabilities(scores), cost, 100.0) == pytest.approx({"a": 0.1, "b": 0.2, "c": 0.1})
    assert decide(scores, cost, 100.0) == ("b", "c", "a")
    assert decide(scores, cost, 1e6)[0] in ("b", "c")  # a huge λ: always a cheapest one
    assert decide({"x": 0.0, "y": 0.0}, {"x": 0.002, "y": 0.001}, 0.0) == ("y", "x")  # a tie goes to the cheaper


async def test_the_client_scores_against_a_vllm_shaped_server():
    with ScriptedServer("vllm") as srv:
        srv.script(COMPLETIONS, scored_completion({"a": -3.0, "b": -0.2, "c": -1.0}, shuffle=True))
        async with started(RouterClient(srv.url(), timeout_s=2.0, mode="score")) as client:
            answer = await client.route("router@1", PROVIDERS, "what is a cell")
        [req] = srv.received
    assert req.json["prompt_logprobs"] == 0 and req.json["max_tokens"] == 1 and len(req.json["prompt"]) == 3
    assert answer.ordering == ("b", "c", "a") and answer.scores == pytest.approx({"a": -3.0, "b": -0.2, "c": -1.0})
    assert answer.raw == "" and answer.latency_ms > 0


async def test_a_server_without_prompt_logprobs_is_an_unparseable_router():
    with ScriptedServer("old-server") as srv:
        srv.script(COMPLETIONS, Reply(200, {"choices": [{"index": i, "text": "x"} for i in range(3)]}))
        async with started(RouterClient(srv.url(), timeout_s=2.0, mode="score")) as client:
            with pytest.raises(RouterUnparseable, match="no candidate scores: choice 0: prompt_logprobs missing"):
                await client.route("router@1", PROVIDERS, "q")


async def test_the_gateway_routes_by_score_and_cost_and_records_both(make, router):  # noqa: F811
    from tests.support.fakes import StaticProvider

    providers = [StaticProvider("a", ("u1",), cost_usd=0.004), StaticProvider("b", ("u2",), cost_usd=0.001),
                 StaticProvider("c", ("u3",), cost_usd=0.001)]
    scores = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)}
    for lam, chosen in ((0.0, "a"), (100.0, "b")):
        rt = await make(providers=providers, mode="score", cost_weight=lam)
        await rt.promote(1)
        router.script(COMPLETIONS, scored_completion(scores))
        body = await rt.search(query_id=f"q-{lam}")
        assert body["route"]["called"] == [chosen] and body["route"]["fallback"] is None
        assert body["route"]["scores"] == pytest.approx(scores, abs=1e-6) and body["route"]["cost_weight"] == lam
        trace = rt.traces[-1]
        assert trace.route.ordering[0] == chosen and trace.route.cost_weight == lam
        assert router.received[-1].json["prompt"][0].endswith("<|im_start|>assistant\na")
        router.reset()
