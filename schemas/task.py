"""Topic ``tasks``: a content-addressed replay task in Harbor's task format.

Producers: episode builder, trainer (run kind rl), ``fanroute rl``. Consumer: rollout runner. The id rule
lives here because the builder writes tasks and the trainer reads them back from a directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message, content_id


def task_id_of(files: Mapping[str, str]) -> str:
    """The content hash of the files (canonical JSON, sorted keys): same files, same id."""
    return content_id(dict(files))


class Task(Message):
    """A replay task; ``task_id`` is the hash of ``files``, so an unchanged task is not new."""

    schema_version: Literal[1] = 1
    task_id: str = Field(min_length=1)
    trace_id: str = Field(min_length=1)
    created_at: datetime
    files: dict[str, str] = Field(description="Relative path -> text (task.toml, instruction.md, ...)")
