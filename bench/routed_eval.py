"""In-process routed evaluation shared by the SFT benches: an adapter asked as the gateway asks it (every
provider name scored as the continuation of the router prompt) and the linear router, each pick made by
the gateway's decision and λ (:func:`gateway_picks`), and a single provider on the same queries, graded
by nDCG@10 against the human qrels, agreement with the judge's cost-aware first choice and the provider
shares.

In-process scoring gives the sampler's decisions (same prompt, same tokens, float32), without a server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def tier_grades(ep: Any) -> dict[str, float]:
    """Each provider's grade from the judge's ordering: the top tier gets the number of tiers, down to 1."""
    from services.common.ndcg import parse_ordering

    tiers = parse_ordering(ep.messages[-1].content)
    return {name: float(len(tiers) - i) for i, tier in enumerate(tiers) for name in tier}


class Queries:
    """Episodes to route (each with the judge's ordering as its answer) and the human nDCG of each provider."""

    def __init__(self, episodes: Sequence[Any], traces: Mapping[str, Any], tokenizer: Any) -> None:
        from services.common.prompt import providers_of
        from services.evaluate.scoring import human_scores
        from services.judge.calibration.human import QrelsStore
        from services.router.linear import first_choice
        from services.trainer.route_eval import route_items

        store = QrelsStore()
        self.episodes = list(episodes)
        self.human = {ep.trace_id: h for ep in self.episodes if ep.trace_id in traces
                      and (h := human_scores(traces[ep.trace_id], store)) is not None}
        self.labels = {ep.episode_id: first_choice(ep) for ep in self.episodes}
        self.grades = {ep.episode_id: tier_grades(ep) for ep in self.episodes}
        self.items = route_items(tokenizer, self.episodes, [self.grades[ep.episode_id] for ep in self.episodes],
                                 [providers_of(ep) for ep in self.episodes])

    def summary(self, picks: Mapping[str, str], cost: Mapping[str, float] | None = None) -> dict[str, Any]:
        """nDCG@10 (qrels), agreement with the label, tier grade and shares of ``picks``; with ``cost``
        (provider → USD), also the mean cost per pick."""
        eps = [ep for ep in self.episodes if ep.episode_id in picks]
        rated = [ep for ep in eps if self.human.get(ep.trace_id)]
        ndcg = [self.human[ep.trace_id].get(picks[ep.episode_id], 0.0) for ep in rated]
        agree = [picks[ep.episode_id] == self.labels[ep.episode_id] for ep in eps]
        grade = [self.grades[ep.episode_id].get(picks[ep.episode_id], 0.0) for ep in eps]
        shares = Counter(picks[ep.episode_id] for ep in eps)
        n = max(len(eps), 1)
        out = {"ndcg10": sum(ndcg) / max(len(ndcg), 1), "n_qrels": len(ndcg), "agree": sum(agree) / n,
               "tier_grade": sum(grade) / n, "shares": {k: round(v / n, 3) for k, v in sorted(shares.items())}}
        if cost is not None:
            out["cost"] = sum(cost.get(v, 0.0) for v in picks.values()) / max(len(picks), 1)
        return out

    def qrels_summary(self, picks: Mapping[str, str], cost: Mapping[str, float]) -> dict[str, Any]:
        """:meth:`summary` for held-out episodes: nDCG@10 (qrels), shares and cost per query. Their answers carry
        no judge label, so agreement and tier grade would mean nothing and are left out."""
        return {k: v for k, v in self.summary(picks, cost).items() if k not in ("agree", "tier_grade")}

    def adapter_picks(self, adapter: Path, base: Path, pad_id: int) -> dict[str, str]:
        """episode id → the provider the adapter's scores choose."""
        return {e: top(p) for e, p in self.adapter_probs(adapter, base, pad_id).items()}

    def adapter_probs(self, adapter: Path, base: Path, pad_id: int) -> dict[str, dict[str, float]]:
        """episode id → the adapter's probability per provider (softmax of its name scores)."""
        import torch
        from peft import PeftModel

        from services.models.load import load_causal_lm
        from services.router.scoring import probabilities
        from services.trainer.route_eval import name_scores

        model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), str(adapter)).eval()
        return {it.episode_id: probabilities(name_scores(model, it, pad_id)) for it in self.items}

    def linear_probs(self, train_episodes: Sequence[Any], seed: int = 0) -> dict[str, dict[str, float]]:
        """episode id → the linear router's probability per provider (fitted on ``train_episodes``)."""
        from services.common.prompt import providers_of, query_of
        from services.router.linear import fit
        from services.router.scoring import probabilities

        router = fit(train_episodes, seed=seed)
        return {ep.episode_id: probabilities(router.scores(query_of(ep), providers_of(ep))) for ep in self.episodes}

    def linear_picks(self, train_episodes: Sequence[Any], seed: int = 0) -> dict[str, str]:
        """episode id → the choice of the linear router fitted on ``train_episodes``."""
        return {e: top(p) for e, p in self.linear_probs(train_episodes, seed).items()}


def top(scores: Mapping[str, float]) -> str:
    """The best-scored provider; a tie goes to the first name in sorted order."""
    return max(sorted(scores), key=scores.get)


def gateway_picks(probs: Mapping[str, Mapping[str, float]], cost: Mapping[str, float], cost_weight: float,
                  rates: Mapping[str, Mapping[str, float]] | None) -> dict[str, str]:
    """episode id → the provider the gateway calls for a router with these probabilities: utility =
    expected quality (top tier through ``rates``, else the first-choice probability) − λ · cost."""
    import math

    from services.router.scoring import decide

    return {e: decide({n: math.log(max(v, 1e-300)) for n, v in p.items()}, cost, cost_weight, rates)[0]
            for e, p in probs.items()}


def hedged(probs: Mapping[str, Mapping[str, float]], tau: float, fallback: str) -> dict[str, str]:
    """The most probable provider per episode, or ``fallback`` where that probability is below ``tau``
    (a router that hands the queries it is unsure of to the best single provider)."""
    return {e: top(p) if p[top(p)] >= tau else fallback for e, p in probs.items()}


def tokenizer_and_base(base_model: str) -> tuple[Any, Path, int]:
    """The prepared base model's directory, its tokenizer and pad id."""
    from transformers import AutoTokenizer

    from services.models.prepare import resolve_base

    base = resolve_base(base_model, prepare=True)
    tok = AutoTokenizer.from_pretrained(base)
    return tok, base, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def truncated_base(base: Path, layers: int, out: Path) -> Path:
    """A copy of the model at ``base`` keeping its first ``layers`` decoder layers (then its final norm and
    output layer), saved with its tokenizer at ``out`` (built once): a shallower student, 2/3 of the
    forward at 20 of SmolLM2's 30 layers."""
    import torch
    from transformers import AutoTokenizer

    from services.common.files import atomic_dir
    from services.models.load import load_causal_lm
    from services.models.prepare import is_prepared

    if is_prepared(out):
        return out
    model = load_causal_lm(base, torch.float32)
    if not 0 < layers < model.config.num_hidden_layers:
        raise ValueError(f"layers must be in 1..{model.config.num_hidden_layers - 1}, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    return out


def new_axes(figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure and axes on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def finish(fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Label the axes, add the legend and write the PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
