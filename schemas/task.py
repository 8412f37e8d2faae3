"""Topic ``tasks``: a content-addressed replay task in Harbor's task format.

Producer: episode builder. Consumer: rollout runner. Filled in by the episodes issue.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message


class Task(Message):
    """A replay task; ``task_id`` is the hash of ``files``, so an unchanged task is not new."""

    schema_version: Literal[1] = 1
    task_id: str = Field(min_length=1)
    trace_id: str = Field(min_length=1)
    created_at: datetime
    files: dict[str, str] = Field(description="Relative path -> text (task.toml, instruction.md, ...)")
