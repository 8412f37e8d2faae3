"""Episode builder settings."""

from __future__ import annotations

from pydantic import Field

from services.common.settings import ServiceSettings


class EpisodeSettings(ServiceSettings):
    """``FANROUTE_`` env vars."""

    group_id: str = Field(default="episodes", min_length=1, max_length=128, pattern=r"^[a-z0-9._-]+$",
                          description="Consumer group of the builder")
    trace_ttl_s: int = Field(default=14 * 86_400, ge=60, le=365 * 86_400,
                             description="How long an unjudged trace waits for a verdict in Redis")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port (0 = off)")
