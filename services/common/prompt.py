"""The router prompt: the one renderer every service shares (episode builder, trainer, router client,
evaluation, and the relay and rollouts to come).

It builds the system and user turns from a provider set and a query, reads them back from an
episode, and names the reward components an episode carries. The ordering line itself
(``a > b = c``) is written and strictly parsed by :mod:`services.common.ndcg`, because the replay
tasks' verifier ships with that one file; what a model writes is parsed tolerantly by
:mod:`services.router.parse`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from schemas.episode import ChatMessage, Episode

SYSTEM_TEMPLATE = (
    "You route search queries to search providers. The providers are: {names}.\n"
    "Read the user's query and answer with every provider, best first, in one line: names "
    "separated by ' > ', equally good providers joined by ' = ' (for example: {example}). "
    "Answer with that line only."
)
_NAMES = re.compile(r"The providers are: ([^\n]*)\.(?:\n|$)")

#: Reward components graded against a judge are named ``ndcg:<judge_model>:<rubric_hash8>``.
REWARD_PREFIX = "ndcg:"


def system_prompt(providers: Iterable[str]) -> str:
    """The system turn: the provider names to choose from, nothing about their answers."""
    names = sorted(set(providers))
    example = " > ".join(names[:2]) + (f" = {names[2]}" if len(names) > 2 else "")
    return SYSTEM_TEMPLATE.format(names=", ".join(names), example=example)


def providers_in(system: str) -> tuple[str, ...]:
    """The provider names a system turn lists (sorted; empty when it lists none): the inverse of
    :func:`system_prompt`."""
    found = _NAMES.search(system)
    return tuple(sorted({n.strip() for n in found.group(1).split(",") if n.strip()})) if found else ()


def router_turns(providers: Iterable[str], query: str) -> tuple[ChatMessage, ChatMessage]:
    """The system and user turns the router sees: what it is trained on and asked at serving time."""
    return (ChatMessage(role="system", content=system_prompt(providers)), ChatMessage(role="user", content=query))


def router_messages(providers: Iterable[str], query: str) -> list[dict[str, str]]:
    """:func:`router_turns` as chat-completions ``messages``."""
    return [{"role": m.role, "content": m.content} for m in router_turns(providers, query)]


def render_chatml(messages: Iterable[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
    """``messages`` as ChatML text, exactly as SmolLM2's (and Qwen's) chat template writes them when the
    conversation has a system turn: what a completions endpoint is sent when the router scores
    continuations of the prompt instead of chatting."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


#: Prompt renderers by model family: the text a completions endpoint must be sent to see what chat saw.
RENDERERS = {"chatml": render_chatml}


def query_of(ep: Episode) -> str:
    """The user turn (the query) of an episode."""
    return next((m.content for m in ep.messages if m.role == "user"), "")


def providers_of(ep: Episode) -> tuple[str, ...]:
    """The provider names listed in an episode's system turn (sorted; empty when there is none)."""
    return providers_in(next((m.content for m in ep.messages if m.role == "system"), ""))


def chat_messages(ep: Episode) -> list[dict[str, str]]:
    """The conversation up to and including its last assistant turn, as chat-template dicts."""
    msgs = [{"role": m.role, "content": m.content} for m in ep.messages]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return msgs[:last + 1]


#: What the assistant turn of a training example says (``fanroute train --target``): the judge's whole
#: cost-aware ordering, only its first name (the decision the router is asked for), or its top tier.
TARGETS = ("ordering", "first", "top-tier")


def _last_answer(ep: Episode) -> tuple[int, list[list[str]] | None]:
    """The index of the last assistant turn and its ordering as tiers (None when it does not parse)."""
    from services.common.ndcg import parse_ordering

    last = max(i for i, m in enumerate(ep.messages) if m.role == "assistant")
    try:
        return last, parse_ordering(ep.messages[last].content)
    except ValueError:
        return last, None


def _answering(ep: Episode, last: int, text: str, **update: str) -> Episode:
    """``ep`` with the turn at ``last`` saying ``text`` (and ``update``'s other fields)."""
    messages = (*ep.messages[:last], ep.messages[last].model_copy(update={"content": text}), *ep.messages[last + 1:])
    return ep.model_copy(update={"messages": messages, **update})


def retarget(ep: Episode, target: str) -> Episode:
    """``ep`` with its last assistant turn reduced to ``target`` (:data:`TARGETS`); an answer that does not
    parse as an ordering, or ``ordering`` itself, leaves the episode as it is.

    Why ``first``: the full ordering is mostly ties with a generalist (``aero = web-lexical > ...``), which
    scores well against the judge's grades and says nothing about the one provider the gateway calls.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    if target == "ordering":
        return ep
    from services.common.ndcg import format_ordering

    last, tiers = _last_answer(ep)
    if tiers is None:
        return ep
    return _answering(ep, last, tiers[0][0] if target == "first" else format_ordering([tiers[0]], keep_tier_order=True))


def tie_variants(ep: Episode, smoothing: float) -> list[tuple[Episode, float]]:
    """Label smoothing over the judge's ties, as weighted ``first`` examples: one per provider in the
    episode's top tier, the cost-aware first choice weighing ``1 − smoothing + smoothing / k`` and each of
    the other k − 1 ``smoothing / k`` (the weights sum to 1, so an episode still counts once). A tier of
    one, a ``smoothing`` of 0 or an answer that does not parse gives ``[(retarget(ep, "first"), 1.0)]``.

    Why: a tie says the judge could not tell those providers apart; a one-hot target on the cheapest
    teaches the student a preference the judge never expressed. A variant's id is the episode's with
    ``#<provider>`` appended, so the examples stay distinct.
    """
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    first = retarget(ep, "first")
    last, tiers = _last_answer(ep) if smoothing else (0, None)
    top = list(dict.fromkeys(tiers[0])) if tiers else []
    if len(top) < 2:
        return [(first, 1.0)]
    k = len(top)
    return [(first, 1 - smoothing + smoothing / k),
            *((_answering(ep, last, name, episode_id=f"{ep.episode_id}#{name}"), smoothing / k) for name in top[1:])]


@dataclass(frozen=True, order=True)
class JudgeKey:
    """The judge half of a gate key, as far as an episode names it (model, rubric hash prefix)."""

    judge_model: str
    rubric_prefix: str

    def __str__(self) -> str:
        return f"{REWARD_PREFIX}{self.judge_model}:{self.rubric_prefix}"


def reward_name(judge_model: str, rubric_hash: str) -> str:
    """The name of the nDCG reward component graded against one judge and rubric."""
    return str(JudgeKey(judge_model, rubric_hash[:8]))


def judge_key_of(name: str) -> JudgeKey | None:
    """``ndcg:<model>:<hash8>`` → JudgeKey (the model may itself contain colons); else None."""
    if not name.startswith(REWARD_PREFIX):
        return None
    model, sep, prefix = name[len(REWARD_PREFIX):].rpartition(":")
    return JudgeKey(model, prefix) if sep and model and prefix else None
