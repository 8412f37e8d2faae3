"""Topics ``<topic>.dlq``: a message that could not be handled, with why.

Producer: any consumer (via services.common.bus). Consumer: people and replay tools.
The record's value is the original bytes, untouched; the reason and origin travel as headers,
which this model gathers back into one object.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from schemas.base import Message


class DeadLetter(Message):
    """A dead-lettered record as read back from a ``.dlq`` topic (bytes are base64 in JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64",
                              val_json_bytes="base64")

    schema_version: Literal[1] = 1
    source_topic: str
    source_partition: int = Field(ge=0)
    source_offset: int = Field(ge=0)
    consumer: str = Field(description="Consumer group that refused it")
    reason: str
    error_type: str
    original: bytes = Field(description="The record's value exactly as it arrived")
    original_key: bytes | None = None
