"""Configuration of the local (offline, no network) judge backend."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Default score cut points for grades 1, 2, 3. Lexical: chosen on 478 dev queries of the first (nested)
#: market, to maximise mean per-trace tau-b against qrels-derived grades. Embedding variant: chosen by
#: ``python bench/judge_tune.py 3`` on the *tuning half* of the dev queries (services.common.splits) over
#: the federated market, with ``embedding_weight`` 0.9 and ``top_sources`` 3 (the defaults the judge
#: service uses, see services.judge.settings.default_judge); the validation half chose nothing.
LEXICAL_THRESHOLDS: tuple[float, float, float] = (0.1, 0.2, 0.3)
EMBEDDING_THRESHOLDS: tuple[float, float, float] = (0.3, 0.4, 0.55)


class LocalJudgeConfig(BaseModel):
    """The local judge: lexical evidence by default, optionally blended with MiniLM similarity.

    ``use_embeddings`` must stay off when a dense provider uses the same model: a judge built
    on the same embeddings as a provider rewards that provider's own notion of similarity (see
    :class:`services.judge.backends.local.LocalJudge`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["local"] = "local"
    use_embeddings: bool = Field(
        default=False, description="Blend MiniLM query–source cosine into the lexical score")
    model_path: str | None = Field(
        default=None, description="sentence-transformers model dir; default: the bundled MiniLM")
    embedding_weight: float = Field(
        default=0.5, ge=0, le=1,
        description="Share of the cosine score in the blend (only with use_embeddings)")
    max_seq_length: int = Field(default=128, ge=16, le=512,
                                description="Tokens per source the model reads")
    thresholds: tuple[float, float, float] | None = Field(
        default=None,
        description="Score cut points in (0, 1] for grades 1, 2 and 3 (strictly increasing); "
                    "default: the variant's calibrated ones")
    top_sources: int = Field(default=5, ge=1, le=50,
                             description="Sources per candidate that count (rank-discounted)")
    embedding_cache: Literal["disk", "off"] = Field(
        default="disk", description="Keep source embeddings in $FANROUTE_JUDGE_CACHE_DIR "
                                    "(default <cache>/judge, see services.common.paths) so a document is embedded once")

    @field_validator("thresholds")
    @classmethod
    def _increasing(cls, v: tuple[float, float, float] | None) -> tuple[float, float, float] | None:
        if v is None:
            return v
        if not all(0 < t <= 1 for t in v):
            raise ValueError(f"thresholds must lie in (0, 1], got {v}")
        if not v[0] < v[1] < v[2]:
            raise ValueError(f"thresholds must be strictly increasing, got {v}")
        return v

    @property
    def cut_points(self) -> tuple[float, float, float]:
        """The thresholds in force: the configured ones, else the variant's default."""
        if self.thresholds is not None:
            return self.thresholds
        return EMBEDDING_THRESHOLDS if self.use_embeddings else LEXICAL_THRESHOLDS
