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


class ScoresUnreadable(ValueError):
    """A completions reply without the per-token prompt log-probabilities of every candidate."""


def score_request(model: str, providers: Sequence[str], query: str, *, prompt_format: str = "chatml") -> dict[str, Any]:
    """The completions body that scores every provider name after the router prompt (greedy, 1 token)."""
    prefix = RENDERERS[prompt_format](router_messages(providers, query), add_generation_prompt=True)
    return {"model": model, "prompt": [prefix + name for name in providers], "max_tokens": 1,
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


def parse_scores(body: Mapping[str, Any], providers: Sequence[str]) -> dict[str, float]:
    """Provider → summed log-probability of its name's tokens (up to a shared constant)."""
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
    return {name: math.fsum(lp for _, lp in seq[shared:]) for name, seq in zip(providers, seqs, strict=True)}


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


def utilities(probs: Mapping[str, float], cost_usd: Mapping[str, float], cost_weight: float) -> dict[str, float]:
    """Expected quality minus λ · cost per provider; the expected quality of a provider is the router's
    probability that it is the judge's best (so λ is in probability per USD)."""
    return {n: p - cost_weight * cost_usd.get(n, 0.0) for n, p in probs.items()}


def decide(scores: Mapping[str, float], cost_usd: Mapping[str, float], cost_weight: float) -> tuple[str, ...]:
    """Providers by utility, best first; ties go to the cheaper, then by name."""
    util = utilities(probabilities(scores), cost_usd, cost_weight)
    return tuple(sorted(util, key=lambda n: (-util[n], cost_usd.get(n, 0.0), n)))
