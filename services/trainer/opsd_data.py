"""OPSD's prompt rows: each episode as the student's prompt, the teacher's hinted prompt and the grades.

Why a module of its own: the student sees the conversation up to its last user turn (what the router
sees when serving); the teacher sees the same conversation with a hint leading its last user turn,
built from the episode's recorded answer and reward values (``reward``) or from the user's rubric
template (``custom``). Both are rendered with the base model's own chat template, so the sampled
completion tokens follow either prompt the same way and only the completion positions are compared.

Where and how the hint is written matters on a 135M model (measured on the demo's SFT adapter, its first six
or ten episodes, log q_teacher - log p_student of the recorded answer / of its end-of-turn token): before the
query in the user turn +1.8 / -0.03 nats; after the query +0.5 / -0.02; after the system turn +1.7 /
-0.3; spelling out the reward's long name (``ndcg:<judge>:<hash>``) after the system turn +2.0 / -5.0,
and with the end of turn that unlikely under the teacher every sample's last token gets a large
negative advantage: one step taught the student not to stop. So the hint leads the user turn and
carries the reward values only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.episode import Episode
from services.common.errors import ConfigError
from services.common.prompt import chat_messages, providers_of, query_of
from services.trainer.data import reward_of, token_ids
from services.trainer.evaluate import GradesFor, tier_grades, tolerant_tiers
from services.trainer.settings import OpsdRun

REWARD_HINT = "Judge's answer ({rewards}): {answer}"


@dataclass(frozen=True)
class PromptRow:
    """One episode as OPSD trains on it: student and teacher prompt tokens, and the grades samples are scored on."""

    episode_id: str
    trace_id: str | None
    student_ids: tuple[int, ...]
    teacher_ids: tuple[int, ...]
    providers: tuple[str, ...]
    grades: Mapping[str, float]
    hint: str

    @property
    def input_ids(self) -> tuple[int, ...]:
        """The student prompt (its length orders the batches, as an SFT example's tokens do)."""
        return self.student_ids


def _rewards_text(ep: Episode) -> str:
    """The reward map's values, short: ``reward 1.00`` or ``rewards 1.00, 0.83`` (names are noise to the teacher)."""
    values = [f"{c.value:.2f}" for c in ep.rewards]
    return f"reward{'s' if len(values) > 1 else ''} {', '.join(values)}" if values else "no reward yet"


def hint_for(ep: Episode, run: OpsdRun) -> str:
    """The hint the teacher sees: the reward map and recorded answer, or the user's rubric filled in."""
    answer = chat_messages(ep)[-1]["content"]
    chosen = reward_of(ep, run.reward_name)
    fields: dict[str, Any] = {"query": query_of(ep), "providers": ", ".join(providers_of(ep)), "answer": answer,
                              "rewards": _rewards_text(ep), "reward": chosen.value if chosen is not None else 0.0}
    if run.hint_mode == "reward":
        return REWARD_HINT.format(**fields)
    try:
        return (run.hint_template or "").format(**fields)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(f"hint_template cannot be filled for episode {ep.episode_id}: {exc}") from exc


def prompt_messages(ep: Episode) -> list[dict[str, str]]:
    """The conversation up to and including its last user turn."""
    msgs = [{"role": m.role, "content": m.content} for m in ep.messages]
    last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last is None:
        raise ConfigError(f"episode {ep.episode_id} has no user turn")
    return msgs[:last + 1]


def hinted_messages(ep: Episode, hint: str) -> list[dict[str, str]]:
    """The student's messages with the hint leading the last user turn: ``<hint>\nQuery: <query>``."""
    msgs = prompt_messages(ep)
    msgs[-1] = {"role": "user", "content": f"{hint}\nQuery: {msgs[-1]['content']}"}
    return msgs


def grades_of(ep: Episode, grades_for: GradesFor | None) -> dict[str, float]:
    """The judge's grades of the episode's trace, else tier ranks of its recorded ordering (as eval does)."""
    grades = grades_for(ep.trace_id) if grades_for is not None and ep.trace_id else None
    if grades is None:
        grades = tier_grades(tolerant_tiers(chat_messages(ep)[-1]["content"]) or ())
    return dict(grades)


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    return tuple(token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)))


def build_rows(tokenizer: Any, episodes: Sequence[Episode], run: OpsdRun, grades_for: GradesFor | None,
               max_tokens: int) -> tuple[list[PromptRow], dict[str, int]]:
    """Rows for ``episodes``; a teacher prompt that leaves no room for ``max_new_tokens`` is dropped."""
    rows, dropped = [], 0
    for ep in episodes:
        hint = hint_for(ep, run)
        student, teacher = _render(tokenizer, prompt_messages(ep)), _render(tokenizer, hinted_messages(ep, hint))
        if len(teacher) + run.max_new_tokens > max_tokens:
            dropped += 1
            continue
        rows.append(PromptRow(ep.episode_id, ep.trace_id, student, teacher, providers_of(ep),
                              grades_of(ep, grades_for), hint))
    counts = {"rows": len(rows), "dropped/over_max_tokens": dropped,
              "prompt_tokens": sum(len(r.student_ids) for r in rows),
              "teacher_prompt_tokens": sum(len(r.teacher_ids) for r in rows)}
    return rows, counts
