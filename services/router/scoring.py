"""The scoring router: score each provider name as the continuation of the prompt the student was
trained on, then choose by expected quality minus λ · cost.

One ``/v1/completions`` call carries K prompts, ``<rendered prompt><name_k>``, with vLLM's
``prompt_logprobs=0``; each choice's ``prompt_logprobs`` gives the log-probability of every prompt
token. A candidate's score is the sum over the tokens after the K prompts' common token prefix: the
tokens they share (the prompt, and any name prefix all candidates share) add the same amount to
every score, so the softmax over candidates is exact without knowing where the name starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.prompt import RENDERERS, router_messages
from services.router.rates import Rates, expected_top_tier


class ScoresUnreadable(ValueError):
    """A completions reply without the per-token prompt log-probabilities of every candidate."""


def score_request(model: str, providers: Sequence[str], query: str, *, prompt_format: str = "chatml",
                  candidates: Sequence[str] | None = None) -> dict[str, Any]:
    """The completions body that scores every provider name (or only ``candidates``) after the router
    prompt listing ``providers`` (greedy, 1 token)."""
    prefix = RENDERERS[prompt_format](router_messages(providers, query), add_generation_prompt=True)
    return {"model": model, "prompt": [prefix + name for name in (providers if candidates is None else candidates)],
            "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0}


def _token_logprobs(entries: Any) -> list[tuple[int, float]]:
    """(token id, logprob) per prompt position after the first, from one choice's ``prompt_logprobs``."""
    if not isinstance(entries, list) or len(entries) < 2:
        raise ScoresUnreadable("prompt_logprobs missing or shorter than two tokens")
    out = []
    for entry in entries[1:]:
        if not isinstance(entry, dict) or not entry:
            raise ScoresUnreadable("a prompt_logprobs entry after the first token is not a token dict")
        if len(entry) != 1:  # prompt_logprobs=0: exactly the actual token at each position
            raise ScoresUnreadable("expected one entry per position (prompt_logprobs=0)")
        (token, info), = entry.items()
        out.append((int(token), float(info["logprob"] if isinstance(info, dict) else info)))
    return out


def parse_scores(body: Mapping[str, Any], providers: Sequence[str], *, prompt_tokens: int | None = None) -> dict[str, float]:
    """Provider → summed log-probability of its name's tokens: after the prompts' common prefix (up to a
    constant shared by every candidate), or after the first ``prompt_tokens`` tokens when given (exact)."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != len(providers):
        raise ScoresUnreadable(f"expected {len(providers)} choices, got "
                               f"{len(choices) if isinstance(choices, list) else type(choices).__name__}")
    by_index = {}
    for i, choice in enumerate(choices):
        index = choice.get("index", i) if isinstance(choice, dict) else i
        try:
            by_index[int(index)] = _token_logprobs(choice.get("prompt_logprobs") if isinstance(choice, dict) else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScoresUnreadable(f"choice {index}: {exc}") from exc
    if sorted(by_index) != list(range(len(providers))):
        raise ScoresUnreadable(f"choice indexes {sorted(by_index)} do not cover the {len(providers)} prompts")
    seqs = [by_index[i] for i in range(len(providers))]
    shared = common_prefix([[t for t, _ in seq] for seq in seqs])
    if len(providers) > 1 and any(len(seq) == shared for seq in seqs):
        raise ScoresUnreadable("two candidates tokenize to the same sequence")
    start = shared if prompt_tokens is None else prompt_tokens - 1  # seqs drop the first prompt token
    if start > shared:
        raise ScoresUnreadable(f"the prompts differ before token {prompt_tokens}: not the router prompt + names")
    return {name: math.fsum(lp for _, lp in seq[start:]) for name, seq in zip(providers, seqs, strict=True)}


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if len({s[i] for s in seqs}) > 1:
            return i
    return n


def probabilities(scores: Mapping[str, float]) -> dict[str, float]:
    """Softmax of the candidates' log-scores: the router's belief that each provider is the best."""
    top = max(scores.values())
    weights = {n: math.exp(s - top) for n, s in scores.items()}
    total = math.fsum(weights.values())
    return {n: w / total for n, w in weights.items()}


def quality(scores: Mapping[str, float], rates: Rates | None = None) -> dict[str, float]:
    """Each provider's expected quality from the router's scores: P(it is the judge's cost-aware first
    choice), or with a top-tier table (:mod:`services.router.rates`) P(it is in the judge's top tier)."""
    probs = probabilities(scores)
    return probs if rates is None else expected_top_tier(probs, rates)


def utilities(probs: Mapping[str, float], cost_usd: Mapping[str, float], cost_weight: float) -> dict[str, float]:
    """Expected quality minus λ · cost per provider (λ in quality per USD)."""
    return {n: p - cost_weight * cost_usd.get(n, 0.0) for n, p in probs.items()}


def decide(scores: Mapping[str, float], cost_usd: Mapping[str, float], cost_weight: float,
           rates: Rates | None = None) -> tuple[str, ...]:
    """Providers by utility, best first; ties go to the cheaper, then by name. ``rates``: decide by the
    top-tier table (the ``top-tier`` decision); None: by the first-choice probability."""
    util = utilities(quality(scores, rates), cost_usd, cost_weight)
    return tuple(sorted(util, key=lambda n: (-util[n], cost_usd.get(n, 0.0), n)))


# ----------------------------------------------------------------------------- first-token decisions
#
# The K-prompt call forwards every name after the prompt. Most provider names start with a token no
# other name starts with, so one forward over the prompt (its system turn from the prefix cache) gives
# their first-token log-probabilities: a standard one-token completion with ``logprobs``. Only names
# that share a first token (``web-lexical``/``web-semantic``) need their own K-prompt call, and only
# when their shared token could win. A singleton's score drops its name's later tokens (their
# probability after the first is ≈ 1 for a trained router); how often that changes the decision is
# measured by ``bench/router_decision.py`` against the K-prompt path.

#: Alternatives per position asked for (vLLM's default ``max_logprobs``).
FIRST_TOKEN_TOP = 20


def first_token_request(model: str, providers: Sequence[str], query: str, *, prompt_format: str = "chatml",
                        top: int = FIRST_TOKEN_TOP) -> dict[str, Any]:
    """The completions body for one greedy token after the router prompt, with its ``top`` alternatives
    keyed by token id (``return_tokens_as_token_ids``; vLLM and the CPU sampler both accept it)."""
    prompt = RENDERERS[prompt_format](router_messages(providers, query), add_generation_prompt=True)
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": top,
            "return_tokens_as_token_ids": True}


def name_groups(body: Mapping[str, Any], providers: Sequence[str], prompt_tokens: int) -> dict[int, tuple[str, ...]]:
    """First token id → the provider names that start with it, read from a K-prompt reply (``body``) whose
    prompts are the ``prompt_tokens``-token router prompt followed by each name."""
    choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
    seqs = [[t for t, _ in _token_logprobs(c.get("prompt_logprobs"))] for c in choices]
    at = prompt_tokens - 1  # prompt_logprobs' first entry (no logprob) is dropped: position p is seqs[.][p - 1]
    if len(seqs) != len(providers) or any(len(s) <= at for s in seqs) or common_prefix(seqs) < at:
        raise ScoresUnreadable(f"the K-prompt reply does not extend the {prompt_tokens}-token prompt by each name")
    groups: dict[int, list[str]] = {}
    for name, seq in zip(providers, seqs, strict=True):
        groups.setdefault(seq[at], []).append(name)
    return {t: tuple(names) for t, names in groups.items()}


def ids_request(model: str, providers: Sequence[str], query: str, *, prompt_format: str = "chatml") -> dict[str, Any]:
    """The K-prompt body that only tokenizes (``return_token_ids``, no ``prompt_logprobs``): what the
    names' tokens are where a server must not be asked for prompt logprobs."""
    body = score_request(model, providers, query, prompt_format=prompt_format)
    del body["prompt_logprobs"]
    return {**body, "return_token_ids": True}


def name_tokens(body: Mapping[str, Any], providers: Sequence[str], prompt_tokens: int) -> dict[str, tuple[int, ...]]:
    """Each provider name's token ids after the ``prompt_tokens``-token router prompt, from the
    ``prompt_token_ids`` of an :func:`ids_request` reply."""
    try:
        choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
        seqs = [[int(t) for t in c["prompt_token_ids"]] for c in choices]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ScoresUnreadable(f"no prompt_token_ids in the K-prompt reply ({type(exc).__name__}: {exc})") from exc
    if len(seqs) != len(providers) or any(len(s) <= prompt_tokens for s in seqs) \
            or common_prefix(seqs) < prompt_tokens:
        raise ScoresUnreadable(f"the K-prompt reply does not extend the {prompt_tokens}-token prompt by each name")
    return {name: tuple(seq[prompt_tokens:]) for name, seq in zip(providers, seqs, strict=True)}


def groups_of(tokens: Mapping[str, Sequence[int]]) -> dict[int, tuple[str, ...]]:
    """First token id → the names that start with it."""
    groups: dict[int, list[str]] = {}
    for name, ids in tokens.items():
        groups.setdefault(ids[0], []).append(name)
    return {t: tuple(names) for t, names in groups.items()}


def split_group(first_lp: float, members: Sequence[str], tokens: Mapping[str, Sequence[int]],
                top: Mapping[int, float]) -> dict[str, float]:
    """Scores of the names sharing a first token from the alternatives ``top`` after their common
    prefix: the shared token's logprob plus each name's first differing token's (the least listed when
    it is not listed; nothing when the name is the common prefix). The common middle tokens, equal for
    every member, are left out, so members rank exactly by the differing token."""
    shared = common_prefix([list(tokens[n]) for n in members])
    floor = min(top.values())
    return {n: first_lp + (top.get(tokens[n][shared], floor) if len(tokens[n]) > shared else 0.0) for n in members}


def common_tokens(members: Sequence[str], tokens: Mapping[str, Sequence[int]]) -> list[int]:
    """The token ids every one of ``members`` starts with."""
    first = list(tokens[members[0]])
    return first[:common_prefix([list(tokens[n]) for n in members])]


def choice_top(choice: Mapping[str, Any]) -> dict[int, float]:
    """Token id → logprob of one choice's first generated token's alternatives."""
    try:
        entries = choice["logprobs"]["top_logprobs"][0]
        out = {int(str(k).removeprefix("token_id:")): float(v) for k, v in entries.items()}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ScoresUnreadable(f"no first-token logprobs keyed by token id ({type(exc).__name__}: {exc})") from exc
    if not out:
        raise ScoresUnreadable("the first token came with no alternatives")
    return out


def top_logprobs(body: Mapping[str, Any]) -> tuple[dict[int, float], int]:
    """(token id → logprob of the first generated token's alternatives, the prompt's token count) of a
    one-prompt completion."""
    try:
        choice = body["choices"][0]
        prompt_tokens = int(body["usage"]["prompt_tokens"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ScoresUnreadable(f"no first-token logprobs keyed by token id ({type(exc).__name__}: {exc})") from exc
    return choice_top(choice), prompt_tokens


def first_token_scores(top: Mapping[int, float], groups: Mapping[int, Sequence[str]],
                       slack: float) -> tuple[dict[str, float], list[tuple[str, ...]]] | None:
    """Scores from the first-token alternatives: a name alone on its first token scores that token's
    logprob; each name of a shared token gets the token's logprob split evenly, and the group is returned
    to be resolved when the token's probability is within ``slack`` of the best single name's (else no
    member can win). A first token missing from the alternatives is bounded by the least one listed.
    None when the best candidate's first token is not listed at all: ask the K-prompt way instead."""
    floor = min(top.values())
    token_lp = {t: top.get(t, floor) for t in groups}
    best = max(token_lp, key=lambda t: (token_lp[t], t in top))  # an unlisted token is at most the floor
    if best not in top:
        return None
    probs = probabilities({str(t): lp for t, lp in token_lp.items()})
    singles = [probs[str(t)] for t, names in groups.items() if len(names) == 1]
    best_single = max(singles, default=0.0)
    scores: dict[str, float] = {}
    unresolved = []
    for t, names in groups.items():
        for n in names:
            scores[n] = token_lp[t] - math.log(len(names))
        if len(names) > 1 and t in top and probs[str(t)] >= best_single - slack:
            unresolved.append(tuple(names))
    return scores, unresolved


def resolve_group(scores: dict[str, float], exact: Mapping[str, float]) -> None:
    """Replace a shared first token's even split by its names' K-prompt scores (in place)."""
    scores.update(exact)
