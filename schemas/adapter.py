"""Topic ``adapters``: a LoRA adapter version was published (or promoted).

Producer: publisher. Consumers: gateway (follows the promoted version), sampler (loads new versions).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message


class AdapterPublished(Message):
    """One adapter version with the hash of each file and where to pull it."""

    schema_version: Literal[1] = 1
    model_id: str = Field(min_length=1)
    version: int = Field(ge=1)
    base_model: str = Field(min_length=1)
    url: str = Field(min_length=1)
    files_sha256: dict[str, str]
    published_at: datetime
    promoted: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)
    fallback_provider: str | None = Field(
        default=None, description="On a promotion: the best single provider measured beside it; routed "
                                  "gateways answer with it when the router cannot")
