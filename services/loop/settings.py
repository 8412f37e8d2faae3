"""Loop settings: what a cycle trains, where it publishes and evaluates, when it runs, when drift calls one early."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from schemas.adapter import ROUTER_MODEL_ID
from services.common.settings import ServiceSettings
from services.router.modes import DEFAULT_MODE, RouterMode

HoldPoint = Literal["started", "trained", "evaluated", "promote_sent", "promoted"]
_AT = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


class LoopSettings(ServiceSettings):
    """``FANROUTE_`` env vars (e.g. ``FANROUTE_PUBLISHER_URL``); ``fanroute loop`` flags override them."""

    publisher_url: str = Field(default="http://127.0.0.1:8010", min_length=1, max_length=2048,
                               pattern=r"^https?://\S+$", description="The adapter publisher (versions, promotion)")
    router_url: str = Field(default="http://127.0.0.1:8001", min_length=1, max_length=2048, pattern=r"^https?://\S+$",
                            description="Where LM candidates are asked during the evaluation (sampler or vLLM)")
    kind: Literal["lm", "linear"] = Field(default="lm", description="The router a cycle trains: the LM student "
                                          "(LoRA SFT from the deployed adapter) or the linear router (TF-IDF + LR)")
    model_id: str = Field(default=ROUTER_MODEL_ID, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
                          description="The model id the cycle publishes and promotes under")
    once: bool = Field(default=False, description="Run one cycle (or finish the one left unfinished) and exit")
    every_s: float = Field(default=86_400.0, ge=1.0, le=30 * 86_400.0,
                           description="Cycle interval in seconds; slots are aligned to multiples of it (UTC)")
    at: str | None = Field(default=None, description="Run daily at this UTC time (HH:MM) instead of every_s")
    min_new_episodes: int = Field(default=50, ge=0, le=10_000_000,
                                  description="A cycle with fewer episodes appended since the last one is skipped")
    dataset_window_s: float | None = Field(
        default=None, gt=0, le=3650 * 86_400.0,
        description="Train on the episodes appended in this many seconds before the slot (None: every one); a "
                    "window is how a router forgets a provider that degraded")
    held_out_fraction: float = Field(default=0.3, gt=0, lt=1,
                                     description="Dev queries held out of training by hash (evaluated on, never trained)")
    allow_uncalibrated: bool = Field(default=False, description="Train even when the judge's calibration gate is closed")
    max_steps: int = Field(default=1000, ge=1, le=1_000_000, description="LM SFT: most optimizer steps per cycle")
    batch_size: int = Field(default=8, ge=1, le=1024, description="LM SFT batch size")
    router_mode: RouterMode = Field(default=DEFAULT_MODE, description="How an LM router is asked in the evaluation")
    router_timeout_s: float = Field(default=5.0, gt=0, le=600, description="Deadline of one router call (eval)")
    router_max_tokens: int = Field(default=8, ge=1, le=1024, description="Greedy tokens an LM router may write")
    max_router_p99_ms: float | None = Field(default=2000.0, gt=0, le=600_000,
                                            description="The promotion's latency rule (None: no limit)")
    bootstrap: int = Field(default=1000, ge=0, le=100_000, description="Paired bootstrap resamples of the evaluation")
    drift_threshold: float = Field(default=0.1, gt=0, le=1,
                                   description="Drift score (largest per-provider grade change / 3) that calls a cycle early")
    drift_min_verdicts: int = Field(default=20, ge=1, le=1_000_000,
                                    description="Verdicts a provider needs in each window to count towards drift")
    drift_check_s: float = Field(default=300.0, ge=0.1, le=86_400.0, description="How often drift is checked between cycles")
    lease_ttl_s: float = Field(default=60.0, ge=1.0, le=3600.0,
                               description="The Redis lease a cycle holds (renewed at a third of it); a dead loop's "
                                           "lease lapses after this long")
    work_dir: Path = Field(default=Path("out/loop"), description="Per-cycle datasets, adapters and eval.json")
    hold_after: HoldPoint | None = Field(
        default=None, description="Fault injection for tests: after writing this phase's record (promote_sent: after the "
                                  "publisher promoted, before the record says so), hold until killed")

    @field_validator("at")
    @classmethod
    def _time_of_day(cls, value: str | None) -> str | None:
        if value is not None and not _AT.match(value):
            raise ValueError(f"{value!r} is not a UTC time of day as HH:MM (e.g. 02:00)")
        return value
