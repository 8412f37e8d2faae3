"""Episodes → supervised examples: load, pick by reward window, check the gate, split, tokenize, batch.

The judge key of an episode is read from its reward names, ``ndcg:<judge_model>:<rubric_hash8>``
(services/common/prompt.py); its provider set from the system turn. Training on a judge whose
(judge, rubric, provider set) has no open calibration gate is refused unless the run is told
``allow_uncalibrated``, which the run then records.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from schemas.base import decode
from schemas.calibration import CalibrationRecord
from schemas.episode import Episode, RewardComponent
from services.common.dataset import merge
from services.common.errors import ConfigError, SchemaError
from services.common.prompt import (
    REWARD_PREFIX,
    JudgeKey,
    chat_messages,
    judge_key_of,
    providers_of,
    query_of,
)
from services.common.settings import KafkaSettings

IGNORE = -100


class UncalibratedError(ConfigError):
    """Episodes come from a judge key whose calibration gate is not open."""


def reward_of(ep: Episode, name: str | None) -> RewardComponent | None:
    """The named reward component, or (name None) the episode's primary one (the verdict that wrote
    its assistant turn), falling back to the first ndcg component for episodes that do not say."""
    if name is None and ep.primary_reward is not None:
        name = ep.primary_reward
    for c in ep.rewards:
        if (c.name == name) if name is not None else c.name.startswith(REWARD_PREFIX):
            return c
    return None


def episode_judge(ep: Episode, reward_name: str | None) -> JudgeKey | None:
    """The judge whose ordering the assistant turn is: the selected reward's, else the first ndcg one's."""
    chosen = reward_of(ep, reward_name)
    key = judge_key_of(chosen.name) if chosen is not None else None
    if key is None:
        first = reward_of(ep, None)
        key = judge_key_of(first.name) if first is not None else None
    return key


# ----------------------------------------------------------------------------- loading


def load_episodes_file(path: Path) -> list[Episode]:
    """Episodes from canonical JSONL; a bad line is a ConfigError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"episodes file {path} does not exist")
    out: dict[str, Episode] = {}
    with path.open("rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ep = decode(Episode, line)
            except SchemaError as exc:
                raise ConfigError(f"{path}:{n}: not an episode: {exc}") from exc
            out[ep.episode_id] = merge(out[ep.episode_id], ep) if ep.episode_id in out else ep
    return [out[k] for k in sorted(out)]


async def load_episodes_topic(kafka: KafkaSettings, as_of: datetime) -> list[Episode]:
    """The dataset as of ``as_of`` from the episodes topic."""
    from services.common.dataset import dataset_as_of

    return await dataset_as_of(kafka, as_of)


# ----------------------------------------------------------------------------- selection


@dataclass
class Selection:
    """Episodes kept by the reward window, with how many each rule dropped."""

    kept: list[Episode]
    counts: dict[str, int]
    reward: str


def select(episodes: Sequence[Episode], reward_name: str | None, lo: float | None, hi: float | None) -> Selection:
    """Episodes with an assistant turn whose reward lies in [lo, hi]; none left is a ConfigError."""
    counts: Counter[str] = Counter(episodes=len(episodes))
    kept = []
    for ep in episodes:
        comp = reward_of(ep, reward_name)
        if not any(m.role == "assistant" for m in ep.messages):
            counts["dropped/no_assistant"] += 1
        elif comp is None and (reward_name is not None or lo is not None or hi is not None):
            counts["dropped/no_reward"] += 1
        elif comp is not None and lo is not None and comp.value < lo:
            counts["dropped/below_min"] += 1
        elif comp is not None and hi is not None and comp.value > hi:
            counts["dropped/above_max"] += 1
        else:
            kept.append(ep)
    counts["selected"] = len(kept)
    label = reward_name or f"first {REWARD_PREFIX}* reward"
    if not kept:
        detail = ", ".join(f"{k.split('/')[1]} {v}" for k, v in sorted(counts.items()) if k.startswith("dropped/"))
        raise ConfigError(f"the reward window [{lo}, {hi}] on {label} selects none of {len(episodes)} "
                          f"episodes ({detail or 'the dataset is empty'})")
    return Selection(kept, dict(counts), label)


# ----------------------------------------------------------------------------- calibration gate

GateLookup = Callable[[JudgeKey, tuple[str, ...]], CalibrationRecord | None]


@dataclass(frozen=True)
class GateCheck:
    """The gate verdict for the episodes of one (judge key, provider set)."""

    judge: str
    providers: tuple[str, ...]
    episodes: int
    status: Literal["open", "closed", "missing", "no-judge", "unchecked"]
    gate_key: str | None = None
    tau_b: float | None = None
    threshold: float | None = None

    def line(self) -> str:
        fig = f" (tau-b {self.tau_b} vs {self.threshold})" if self.status == "closed" else ""
        return f"{self.judge} on [{', '.join(self.providers)}]: gate {self.status}{fig}, {self.episodes} episodes"


def _groups(episodes: Iterable[Episode], reward_name: str | None) -> dict[tuple[JudgeKey | None, tuple[str, ...]], int]:
    groups: Counter[tuple[JudgeKey | None, tuple[str, ...]]] = Counter()
    for ep in episodes:
        groups[(episode_judge(ep, reward_name), providers_of(ep))] += 1
    return dict(groups)


def judge_keys(episodes: Iterable[Episode], reward_name: str | None) -> set[tuple[JudgeKey, tuple[str, ...]]]:
    """The (judge key, provider set) pairs the episodes need gates for."""
    return {k for k in _groups(episodes, reward_name) if k[0] is not None}  # type: ignore[misc]


def check_gates(episodes: Sequence[Episode], reward_name: str | None, lookup: GateLookup | None,
                allow_uncalibrated: bool) -> list[GateCheck]:
    """One GateCheck per (judge, providers); any not open raises UncalibratedError unless allowed.

    ``lookup`` None (an offline run told to allow uncalibrated judges) marks every key unchecked.
    """
    checks = []
    for (key, providers), n in sorted(_groups(episodes, reward_name).items(), key=lambda kv: str(kv[0])):
        if key is None:
            checks.append(GateCheck("(no ndcg reward: judge unknown)", providers, n, "no-judge"))
            continue
        if lookup is None:
            checks.append(GateCheck(str(key), providers, n, "unchecked"))
            continue
        rec = lookup(key, providers)
        status = "missing" if rec is None else ("open" if rec.open else "closed")
        checks.append(GateCheck(str(key), providers, n, status, rec.gate_key if rec else None,
                                rec.tau_b if rec else None, rec.threshold if rec else None))
    shut = [c for c in checks if c.status != "open"]
    if shut and not allow_uncalibrated:
        raise UncalibratedError(
            f"refusing {sum(c.episodes for c in shut)} of {len(episodes)} episodes: their judge has no open "
            "calibration gate (fanroute calibrate report --publish), or pass --allow-uncalibrated:\n  "
            + "\n  ".join(c.line() for c in shut))
    return checks


async def kafka_gate_lookup(kafka: KafkaSettings, wanted: Iterable[tuple[JudgeKey, tuple[str, ...]]]) -> GateLookup:
    """A lookup over the calibrations topic, read once: for each wanted (judge model, rubric prefix,
    providers) the newest matching gate (:meth:`services.common.gates.Gates.for_judge`)."""
    from services.common.gates import read_gates

    gates = await read_gates(kafka)
    found = {(key, tuple(providers)): gates.for_judge(key, providers) for key, providers in wanted}
    return lambda key, providers: found.get((key, tuple(providers)))


# ----------------------------------------------------------------------------- split


def query_fraction(ep: Episode) -> float:
    """A stable number in [0, 1) from the normalised query: the same query always lands on one side."""
    digest = hashlib.sha256(" ".join(query_of(ep).lower().split()).encode()).hexdigest()
    return int(digest[:12], 16) / 16**12


def content_key(ep: Episode) -> tuple[str, tuple[str, ...], str]:
    """What an episode says (its query, then every turn), its id last: the order batches are drawn in.

    Why not the id alone: an episode's id derives from its trace's id, a random one per request, so two
    runs over the same judged traffic sorted the same episodes differently, and the seeded shuffle then
    gave them other batches and another adapter."""
    return query_of(ep), tuple(m.content for m in ep.messages), ep.episode_id


def split_by_query(episodes: Sequence[Episode], eval_fraction: float) -> tuple[list[Episode], list[Episode]]:
    """(train, held out), each in :func:`content_key` order: a query is held out when its hash fraction
    is below ``eval_fraction``."""
    train, held = [], []
    for ep in sorted(episodes, key=content_key):
        (held if query_fraction(ep) < eval_fraction else train).append(ep)
    return train, held


# ----------------------------------------------------------------------------- tokenization


def token_ids(encoded: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned (list or BatchEncoding)."""
    if isinstance(encoded, list):
        return list(encoded)
    return list(encoded["input_ids"])


def prompt_ids(tokenizer: Any, ep: Episode) -> list[int]:
    """The conversation before the last assistant turn, ending in the template's assistant header."""
    msgs = chat_messages(ep)[:-1]
    return token_ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))


@dataclass(frozen=True)
class Example:
    """One supervised example: tokens, and labels that are IGNORE except on the assistant turn."""

    episode_id: str
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    truncated: bool
    weight: float = 1.0  # the loss weight of its target tokens (class balancing; 1 = plain mean)

    @property
    def n_target(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


def build_example(tokenizer: Any, ep: Episode, max_tokens: int) -> Example:
    """Tokens from the model's own chat template; loss on the last assistant turn through its end token.

    The prompt (with the assistant header) must be a token prefix of the whole conversation, so the
    assistant span is exactly the tokens after it; anything after the end-of-turn token (ChatML's
    newline) is not trained on. Longer than ``max_tokens``: cut at the end, marked truncated.
    """
    prompt = prompt_ids(tokenizer, ep)
    full = token_ids(tokenizer.apply_chat_template(chat_messages(ep), tokenize=True))
    if full[:len(prompt)] != prompt:
        raise ConfigError("the base model's chat template does not render the prompt as a prefix of the "
                          f"conversation (episode {ep.episode_id}); cannot mask the assistant turn")
    target = full[len(prompt):]
    eos = tokenizer.eos_token_id
    end = target.index(eos) + 1 if eos in target else len(target)
    labels = [IGNORE] * len(prompt) + target[:end] + [IGNORE] * (len(target) - end)
    truncated = len(full) > max_tokens
    return Example(ep.episode_id, tuple(full[:max_tokens]), tuple(labels[:max_tokens]), truncated)


@dataclass
class ExampleSet:
    """Examples that still carry a target after truncation, and what happened on the way."""

    examples: list[Example]
    counts: dict[str, int] = field(default_factory=dict)


def build_examples(tokenizer: Any, episodes: Sequence[Episode], max_tokens: int) -> ExampleSet:
    """Examples for ``episodes``; truncations are counted, examples left with no target dropped."""
    counts: Counter[str] = Counter()
    out = []
    for ep in episodes:
        ex = build_example(tokenizer, ep, max_tokens)
        counts["truncated"] += ex.truncated
        if ex.n_target == 0:
            counts["dropped/no_target_after_truncation"] += 1
            continue
        counts["tokens"] += len(ex.input_ids)
        counts["target_tokens"] += ex.n_target
        out.append(ex)
    counts["examples"] = len(out)
    return ExampleSet(out, dict(counts))


# ----------------------------------------------------------------------------- batching


def batch_order(lengths: Sequence[int], batch_size: int, window: int, seed: int) -> list[list[int]]:
    """Example indices in batches for one pass: shuffled, sorted by length within windows of
    ``window`` batches (so a batch pads little), batches shuffled. Exactly ceil(N / batch_size) batches."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * window
    batches: list[list[int]] = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: lengths[i])
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    """A right-padded batch (B examples × T tokens)."""

    input_ids_BT: Any
    attention_mask_BT: Any
    labels_BT: Any
    weight_B: Any = None  # per-example loss weights; None = every example weighs 1

    @property
    def tokens(self) -> int:
        return int(self.attention_mask_BT.sum())

    @property
    def nonpad_fraction(self) -> float:
        return self.tokens / self.attention_mask_BT.numel()


def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Pad to the longest example; padding is masked from attention and loss."""
    import torch

    T = max(len(e.input_ids) for e in examples)
    input_ids_BT = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels_BT = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(examples), T), dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids_BT[b, :n] = torch.tensor(e.input_ids)
        labels_BT[b, :n] = torch.tensor(e.labels)
        attention_mask_BT[b, :n] = 1
    weights = [e.weight for e in examples]
    weight_B = None if all(w == 1.0 for w in weights) else torch.tensor(weights, dtype=torch.float32)
    return Batch(input_ids_BT, attention_mask_BT, labels_BT, weight_B)


def micro_batches(examples: Sequence[Example], max_padded_tokens: int) -> list[list[Example]]:
    """``examples`` in groups whose padded size (rows × longest) stays within ``max_padded_tokens`` (a group
    holds one example at least; 0 keeps the batch whole). Longest first, so each group pads little."""
    if max_padded_tokens <= 0:
        return [list(examples)]
    groups: list[list[Example]] = []
    for e in sorted(examples, key=lambda e: len(e.input_ids), reverse=True):
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0].input_ids) <= max_padded_tokens:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def balance_weights(labels: Sequence[str | None], strength: float) -> list[float]:
    """Per-example loss weights ∝ (examples with the same label) ** -strength, mean 1 over the set.

    0 leaves every weight at 1; 1 gives each label the same total weight; 0.5 is in between (the
    minority labels count more without the rarest few dominating). An unlabelled example weighs 1.
    """
    counts = Counter(lab for lab in labels if lab is not None)
    if strength == 0 or not counts:
        return [1.0] * len(labels)
    raw = [counts[lab] ** -strength if lab is not None else None for lab in labels]
    known = [w for w in raw if w is not None]
    mean = sum(known) / len(known)
    return [w / mean if w is not None else 1.0 for w in raw]


def padding_stats(examples: Sequence[Example], batches: Sequence[Sequence[int]]) -> dict[str, float]:
    """Non-pad fraction the batch order gives over the whole pass."""
    real = padded = 0
    for b in batches:
        lens = [len(examples[i].input_ids) for i in b]
        real += sum(lens)
        padded += max(lens) * len(lens)
    return {"nonpad_fraction": real / padded if padded else 1.0}
