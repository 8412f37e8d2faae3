"""Console settings: where it listens, what it reads, where it keeps what it read, and who may write."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from services.common.settings import ServiceSettings


class ConsoleSettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_CONSOLE_TOKEN=... FANROUTE_CONSOLE_REVIEWER=alice``."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255,
                      description="Listen address (loopback by default: the console shows every query)")
    port: int = Field(default=8030, ge=0, le=65535, description="Listen port (0 = any free port)")
    console_token: SecretStr | None = Field(
        default=None, description="The token a reviewer signs in with; without it the console is read-only")
    console_reviewer: str = Field(default="operator", min_length=1, max_length=128, pattern=r"^[\w .@-]+$",
                                  description="The name the token's reviews carry")
    store_path: Path = Field(default=Path("out/console/console.sqlite3"),
                             description="SQLite file holding what the console read from the topics")
    runs_dir: Path = Field(default=Path("out"),
                           description="Searched for training runs (a metrics.jsonl) and evaluations (eval.json)")
    max_run_depth: int = Field(default=5, ge=1, le=12, description="How deep below runs_dir runs are looked for")
    page_size: int = Field(default=50, ge=1, le=500, description="Traces per page")
    follow_poll_ms: int = Field(default=1000, ge=10, le=60_000, description="Longest wait for new records per poll")
    max_body_bytes: int = Field(default=16_384, ge=256, le=1_048_576, description="Largest form body (a review)")
    refresh_s: float = Field(default=5.0, ge=0.5, le=3600, description="How often a live run page redraws")

    @model_validator(mode="after")
    def _token_not_blank(self) -> ConsoleSettings:
        if self.console_token is not None and not self.console_token.get_secret_value().strip():
            raise ValueError("console_token: empty; unset it for a read-only console")
        return self
