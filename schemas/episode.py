"""Topic ``episodes``: the query-only training example distilled from a judged trace.

Producer: episode builder (and ``POST /v1/episodes``). Consumer: trainer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message


class ChatMessage(Message):
    """One conversation turn."""

    schema_version: Literal[1] = 1
    role: Literal["system", "user", "assistant"]
    content: str


class RewardComponent(Message):
    """A named reward, idempotent by ``component_id``: a new rubric adds one, never overwrites."""

    schema_version: Literal[1] = 1
    component_id: str = Field(min_length=1)
    name: str = Field(min_length=1, description="e.g. 'ndcg' or 'ndcg@rubric-<hash>'")
    value: float
    source: str = Field(default="", description="Verdict id or telemetry file that produced it")


class Episode(Message):
    """Conversation (system names providers, user = query, assistant = ordering) plus rewards."""

    schema_version: Literal[1] = 1
    episode_id: str = Field(min_length=1)
    trace_id: str | None = None
    created_at: datetime
    messages: tuple[ChatMessage, ...] = Field(min_length=2)
    rewards: tuple[RewardComponent, ...] = ()
    primary_reward: str | None = Field(
        default=None, description="Name of the reward component whose verdict wrote the assistant turn "
                                  "(its judge's gate is the one that matters for training)")
    token_ids: tuple[int, ...] | None = Field(default=None, description="Exact tokens, when sampled")
    label_rule: str | None = Field(
        default=None, max_length=200,
        description="How the assistant turn orders providers the judge tied (e.g. cheaper first, then faster)")
