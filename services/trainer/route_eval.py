"""The trainer's held-out evaluation of what routing does: each provider name scored as the continuation
of the router prompt — exactly the gateway's score mode — and the chosen provider graded.

Why: the loss and the tie-tolerant nDCG of a written ordering do not measure the decision. A student
that answers ``aero = web-lexical`` everywhere scores well on the latter and routes badly. These
figures are the ones checkpoint choice and early stopping should read:

- ``test/route_grade``: mean grade (the judge's, or the ordering's tier rank) of the provider chosen;
- ``test/route_best``: share of queries where the chosen provider has the best grade;
- ``test/route_agree``: share where it is the episode's cost-aware first choice (the label);
- ``test/route_share/<name>``: how often each provider is chosen (a two-class student shows here);
- ``test/route_cost``: mean cost per call of the choices (when the run is given the providers' costs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.episode import Episode
from services.common.prompt import chat_messages
from services.router.linear import first_choice
from services.router.rates import Rates
from services.router.scoring import common_prefix, decide
from services.trainer.shared_prefix import plain_head, suffix_hidden


@dataclass(frozen=True)
class RouteItem:
    """One held-out query: each provider's token sequence, where the names start, the label, the grades."""

    episode_id: str
    providers: tuple[str, ...]
    sequences: tuple[tuple[int, ...], ...]
    shared: int  # tokens every sequence shares (the prompt, and any common name prefix)
    label: str | None
    grades: Mapping[str, float]


def route_items(tokenizer: Any, episodes: Sequence[Episode], grades: Sequence[Mapping[str, float]],
                providers: Sequence[Sequence[str]]) -> list[RouteItem]:
    """Items as the router asks: the prompt text (chat template, assistant header) with each name appended,
    tokenized as one text, as the sampler tokenizes a completions prompt."""
    items = []
    for ep, g, names in zip(episodes, grades, providers, strict=True):
        if len(names) < 2:
            continue
        text = tokenizer.apply_chat_template(chat_messages(ep)[:-1], add_generation_prompt=True, tokenize=False)
        seqs = tuple(tuple(tokenizer(text + n, add_special_tokens=False)["input_ids"]) for n in names)
        shared = common_prefix(seqs)
        if any(len(s) == shared for s in seqs):
            continue  # two names tokenize alike: not a decision this prompt can make
        items.append(RouteItem(ep.episode_id, tuple(names), seqs, shared, first_choice(ep), dict(g)))
    return items


def name_scores(model: Any, item: RouteItem, pad_id: int) -> dict[str, float]:
    """Provider → summed log-probability of its name's tokens after the shared prefix (one forward)."""
    import torch

    T = max(len(s) for s in item.sequences)
    ids_KT = torch.full((len(item.sequences), T), pad_id, dtype=torch.long)
    mask_KT = torch.zeros_like(ids_KT)
    for k, s in enumerate(item.sequences):
        ids_KT[k, :len(s)] = torch.tensor(s)
        mask_KT[k, :len(s)] = 1
    start = max(item.shared - 1, 0)  # only the rows that predict a name token are projected onto the vocabulary
    with torch.no_grad():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if plain_head(base):  # the prompt forwarded once for all K names (services.trainer.shared_prefix)
            logits_KSV = base.get_output_embeddings()(suffix_hidden(base.get_decoder(), ids_KT, mask_KT, start))
        else:
            logits_KSV = model(input_ids=ids_KT, attention_mask=mask_KT).logits[:, start:]
        logp_KSV = torch.log_softmax(logits_KSV.float(), dim=-1)
    out = {}
    for k, (name, s) in enumerate(zip(item.providers, item.sequences, strict=True)):
        positions = range(item.shared, len(s))
        out[name] = math.fsum(float(logp_KSV[k, t - 1 - start, s[t]]) for t in positions)
    return out


def route_evaluate(model: Any, items: Sequence[RouteItem], pad_id: int, rates: Rates | None = None,
                   cost_usd: Mapping[str, float] | None = None, cost_weight: float = 0.0) -> dict[str, float]:
    """The routing figures of the module docstring over ``items`` (empty when there are none), each pick the
    gateway's decision: expected quality − ``cost_weight`` · cost, by the top tier with ``rates``, else by the
    first choice."""
    if not items:
        return {}
    was_training = model.training
    model.eval()
    try:
        picks = []
        for item in items:
            picks.append(decide(name_scores(model, item, pad_id), cost_usd or {}, cost_weight, rates)[0])
    finally:
        model.train(was_training)
    n = len(items)
    grade = [it.grades.get(p, 0.0) for it, p in zip(items, picks, strict=True)]
    best = [g == max(it.grades.values(), default=0.0) and g > 0 for it, g in zip(items, grade, strict=True)]
    labelled = [(it.label, p) for it, p in zip(items, picks, strict=True) if it.label is not None]
    shares = Counter(picks)
    return {"test/route_grade": sum(grade) / n, "test/route_best": sum(best) / n,
            "test/route_agree": (sum(lab == p for lab, p in labelled) / len(labelled)) if labelled else float("nan"),
            "test/route_n": n, **({"test/route_cost": sum(cost_usd.get(p, 0.0) for p in picks) / n} if cost_usd else {}),
            **{f"test/route_share/{name}": c / n for name, c in sorted(shares.items())}}
