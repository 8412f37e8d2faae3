"""Topic ``adapters``: a LoRA adapter version was published (or promoted).

Producer: publisher. Consumers: gateway (follows the promoted version), sampler (loads new versions).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.base import Message

#: A model id: safe as a directory name, a URL path segment and a Redis key part.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: The model id routers are published under, unless a deployment names another.
ROUTER_MODEL_ID = "router"
#: The served name of one published version, ``<model_id>@<version>``.
VERSIONED = re.compile(r"^(?P<model_id>.+)@(?P<version>[1-9][0-9]{0,8})$")


def versioned_name(model_id: str, version: int) -> str:
    """The served name of one published version: ``<model_id>@<version>``."""
    return f"{model_id}@{version}"


def parse_versioned(name: str) -> tuple[str, int] | None:
    """``"router@7"`` → ``("router", 7)``; anything else → None."""
    m = VERSIONED.match(name)
    return (m["model_id"], int(m["version"])) if m else None


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
