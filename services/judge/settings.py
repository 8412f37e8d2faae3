"""Judge worker settings: which judge, how much to sample, and the provider set being judged."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Union

from pydantic import Field, model_validator

from services.common.settings import ServiceSettings
from services.judge.settings_backends import AnthropicJudgeConfig, OpenAIJudgeConfig
from services.judge.settings_local import LocalJudgeConfig
from services.providers.config import ProviderConfig
from services.providers.markets import (
    DEFAULT_MARKET,
    MarketName,
    default_providers,
    providers_in_force,
)

JudgeConfig = Annotated[Union[LocalJudgeConfig, OpenAIJudgeConfig, AnthropicJudgeConfig],
                        Field(discriminator="type")]


def default_judge() -> LocalJudgeConfig:
    """The local judge on MiniLM evidence: weight, cut points and sources per candidate chosen by
    ``bench/judge_tune.py 3`` on the tuning half (0.9: cosine with a little lexical coverage)."""
    return LocalJudgeConfig(use_embeddings=True, embedding_weight=0.9, top_sources=3)


class JudgeSettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_JUDGE='{"type": "openai", ...}'``."""

    judge: JudgeConfig = Field(default_factory=default_judge,
                               description="The judge backend (default: the local judge, lexical + MiniLM evidence, "
                                           "which no provider of the federated market embeds with)")
    sample_rate: float = Field(default=0.2, ge=0, le=1,
                               description="Share of uncontested traces judged (contested: all)")
    market: MarketName = Field(default=DEFAULT_MARKET, description="Provider market preset (as the gateway's)")
    providers: list[ProviderConfig] = Field(default_factory=default_providers,
                                            description="The provider set being judged (as the gateway's)")
    providers_file: Path | None = Field(default=None, description="Same file as the gateway's")
    group_prefix: str = Field(default="judge", min_length=1, max_length=64, pattern=r"^[a-z0-9._-]+$",
                              description="Consumer group prefix; the judge key is appended")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port (0 = off)")

    @model_validator(mode="after")
    def _load_file(self) -> JudgeSettings:
        object.__setattr__(self, "providers", providers_in_force(
            self.providers, explicit="providers" in self.model_fields_set, providers_file=self.providers_file,
            market_name=self.market))
        return self


def build_backend(cfg: LocalJudgeConfig | OpenAIJudgeConfig | AnthropicJudgeConfig):
    """The backend object for a config (nothing is loaded until ``start()``)."""
    if isinstance(cfg, LocalJudgeConfig):
        from services.judge.backends.local import LocalJudge

        return LocalJudge(cfg)
    if isinstance(cfg, OpenAIJudgeConfig):
        from services.judge.backends.openai import OpenAIJudge

        return OpenAIJudge(cfg)
    from services.judge.backends.anthropic import AnthropicJudge

    return AnthropicJudge(cfg)
