"""Held-out evaluation: the student's greedy ordering scored against the judge's grades.

Grades come from the judge's verdict for the episode's trace when one is given (``grades_for``,
by default the verdicts topic). Without a verdict they are *tier ranks* of the episode's own
assistant ordering (the judge's ordering): with T tiers, tier i (0 = best) gets grade T - i, so
the judge's ordering itself scores 1.0 and an answer is credited for how close its tiers come.
A malformed answer scores 0; unknown names gain nothing (parse_ordering without a name list).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.episode import Episode
from schemas.verdict import Verdict
from services.common.ndcg import parse_ordering, tie_aware_ndcg
from services.common.prompt import JudgeKey, chat_messages, providers_of
from services.common.settings import KafkaSettings
from services.trainer.data import prompt_ids

GradesFor = Callable[[str], Mapping[str, float] | None]


@dataclass(frozen=True)
class EvalItem:
    """One held-out query: the prompt tokens and the grades its answer is scored against."""

    episode_id: str
    prompt_ids: tuple[int, ...]
    providers: tuple[str, ...]
    grades: Mapping[str, float]
    from_verdict: bool


def tier_grades(tiers: Sequence[Sequence[str]]) -> dict[str, float]:
    """Grades from an ordering's tier ranks: best tier T, then T-1, ... down to 1."""
    return {name: float(len(tiers) - i) for i, tier in enumerate(tiers) for name in tier}


def first_line(text: str) -> str:
    """The answer's first non-empty line (the ordering line)."""
    return next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")


def tolerant_tiers(text: str) -> tuple[tuple[str, ...], ...] | None:
    """The ordering on the answer's first non-empty line (unknown names kept), or None if it does not parse."""
    line = first_line(text)
    try:
        return parse_ordering(line) if line else None
    except ValueError:
        return None


def is_valid(text: str, providers: Sequence[str]) -> bool:
    """The answer is a well-formed ordering of known provider names (each at most once)."""
    try:
        parse_ordering(first_line(text), names=providers)
    except ValueError:
        return False
    return True


def top1(tiers: Sequence[Sequence[str]], grades: Mapping[str, float]) -> float:
    """1.0 when the answer's top tier holds a provider with the best grade, else 0.0."""
    best = max(grades.values(), default=0.0)
    return 1.0 if tiers and best > 0 and any(grades.get(n, 0.0) == best for n in tiers[0]) else 0.0


def score(text: str, grades: Mapping[str, float]) -> tuple[float, float]:
    """(nDCG, top-1) of one answer; an answer that does not parse scores (0, 0)."""
    tiers = tolerant_tiers(text)
    if tiers is None:
        return 0.0, 0.0
    return tie_aware_ndcg(tiers, grades), top1(tiers, grades)


def eval_items(tokenizer: Any, episodes: Sequence[Episode], grades_for: GradesFor | None) -> list[EvalItem]:
    """Eval items; grades from ``grades_for(trace_id)`` when it answers, else tier ranks."""
    items = []
    for ep in episodes:
        grades = grades_for(ep.trace_id) if grades_for is not None and ep.trace_id else None
        from_verdict = grades is not None
        if grades is None:
            answer = chat_messages(ep)[-1]["content"]
            grades = tier_grades(tolerant_tiers(answer) or ())
        items.append(EvalItem(ep.episode_id, tuple(prompt_ids(tokenizer, ep)), providers_of(ep), dict(grades),
                              from_verdict))
    return items


def generate(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             batch_size: int = 8) -> list[str]:
    """Greedy completions of token prompts (left-padded batches), decoded without special tokens."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            T = max(len(p) for p in chunk)
            input_ids_BT = torch.full((len(chunk), T), pad, dtype=torch.long)
            attention_mask_BT = torch.zeros((len(chunk), T), dtype=torch.long)
            for b, p in enumerate(chunk):
                input_ids_BT[b, T - len(p):] = torch.tensor(p)
                attention_mask_BT[b, T - len(p):] = 1
            with torch.no_grad():
                gen_BT = model.generate(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                                        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                        eos_token_id=tokenizer.eos_token_id)
            out += tokenizer.batch_decode(gen_BT[:, T:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def evaluate(model: Any, tokenizer: Any, items: Sequence[EvalItem], max_new_tokens: int) -> dict[str, float]:
    """Mean ``test/ndcg``, ``test/top1`` and ``test/parse_ok`` (well-formed, known names) over ``items``."""
    if not items:
        return {}
    answers = generate(model, tokenizer, [i.prompt_ids for i in items], max_new_tokens)
    scores = [score(a, i.grades) for a, i in zip(answers, items)]
    n = len(items)
    return {"test/ndcg": sum(s[0] for s in scores) / n, "test/top1": sum(s[1] for s in scores) / n,
            "test/parse_ok": sum(is_valid(a, i.providers) for a, i in zip(answers, items)) / n, "test/n": n,
            "test/grades_from_verdicts": sum(i.from_verdict for i in items) / n}


async def kafka_grades(kafka: KafkaSettings, wanted: Mapping[str, JudgeKey]) -> GradesFor:
    """``grades_for`` over the verdicts topic: for each wanted trace, the newest ok verdict of its judge."""
    from schemas.topics import topic
    from services.common.replay_topic import read_topic

    found: dict[str, Verdict] = {}
    async for v in read_topic(kafka, topic("verdicts"), model=Verdict):
        judge = wanted.get(v.trace_id)
        if (v.status == "ok" and judge is not None and v.judge_model == judge.judge_model
                and v.rubric_hash.startswith(judge.rubric_prefix)
                and (v.trace_id not in found or v.judged_at >= found[v.trace_id].judged_at)):
            found[v.trace_id] = v
    grades = {t: {g.provider: float(g.grade) for g in v.grades} for t, v in found.items()}
    return grades.get


def load_kafka_grades(kafka: KafkaSettings, wanted: Mapping[str, JudgeKey]) -> GradesFor:
    """Synchronous wrapper of :func:`kafka_grades`."""
    return asyncio.run(kafka_grades(kafka, wanted))
