"""Provider configuration: a discriminated union on ``type`` (one class per backend)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr

ALL_COLLECTIONS = ("adi", "cacm", "cisi", "cranfield", "lisa", "med", "npl", "scifact")


class LatencyModel(BaseModel):
    """Simulated network latency added to a local provider's real compute time.

    Drawn from a log-normal with the given median and spread, seeded by (provider, query), so a
    replay of the same query sees the same latency and the cost/latency trade-off is in the data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    median_ms: float = Field(default=0.0, ge=0, le=60_000, description="Median added latency")
    sigma: float = Field(default=0.0, ge=0, le=3, description="Log-normal shape (0 = constant)")


class _Common(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.-]*$",
                      description="Provider name as it appears on traces")
    enabled: bool = Field(default=True, description="Disabled providers are not called")
    timeout_s: float = Field(default=5.0, gt=0, le=120, description="Per-call timeout")
    cost_usd: float = Field(default=0.0, ge=0, le=10, description="Cost charged per call")
    k: int = Field(default=10, ge=1, le=100, description="Citations per answer")


class _Local(_Common):
    collections: tuple[str, ...] = Field(default=ALL_COLLECTIONS, min_length=1,
                                         description="Collections this provider indexes")
    latency: LatencyModel = Field(default_factory=LatencyModel)


class _Lexical(_Local):
    lead_chars: int | None = Field(default=None, ge=20, le=100_000,
                                   description="Index only the title and the first this many characters of "
                                               "each document (a shallow index); None = the full text")


class BM25Config(_Lexical):
    """BM25 (bm25s, Snowball-stemmed) over local test collections."""

    type: Literal["bm25"] = "bm25"
    k1: float = Field(default=1.5, gt=0, le=5, description="BM25 k1")
    b: float = Field(default=0.75, ge=0, le=1, description="BM25 b")


class LSAConfig(_Lexical):
    """Latent semantic indexing: cosine in a truncated-SVD space of the TF-IDF matrix (no neural model)."""

    type: Literal["lsa"] = "lsa"
    dim: int = Field(default=200, ge=8, le=1000, description="SVD dimensions kept")


class HybridConfig(_Lexical):
    """BM25 fused with LSA: ``bm25 / max(bm25) + lsa_weight * max(cosine, 0)`` per document."""

    type: Literal["hybrid"] = "hybrid"
    k1: float = Field(default=1.2, gt=0, le=5, description="BM25 k1")
    b: float = Field(default=0.75, ge=0, le=1, description="BM25 b")
    dim: int = Field(default=200, ge=8, le=1000, description="SVD dimensions of the LSA part")
    lsa_weight: float = Field(default=0.3, ge=0, le=5, description="Weight of the LSA cosine in the fusion")


class DenseConfig(_Local):
    """Dense retrieval with a sentence-transformers model (all-MiniLM-L6-v2 by default)."""

    type: Literal["dense"] = "dense"
    model_path: str | None = Field(default=None, description="Model dir; default: bundled MiniLM")
    max_seq_length: int = Field(default=128, ge=16, le=512, description="Tokens per document")


class SyntheticConfig(_Common):
    """Fixed-latency provider with canned citations, for benchmarks and load tests."""

    type: Literal["synthetic"] = "synthetic"
    latency_ms: float = Field(default=50.0, ge=0, le=60_000, description="Fixed answer latency")
    corpus_size: int = Field(default=1000, ge=1, le=10_000_000, description="Synthetic doc ids")


class _Web(_Common):
    base_url: str = Field(min_length=1, description="API base URL")
    api_key: SecretStr | None = Field(default=None, description="API key (never logged)")
    max_retries: int = Field(default=1, ge=0, le=5, description="Retries on 429/5xx within timeout")


class SearxngConfig(_Web):
    """A SearXNG instance's JSON API (``/search?format=json``)."""

    type: Literal["searxng"] = "searxng"


class BraveConfig(_Web):
    """Brave Search Web API."""

    type: Literal["brave"] = "brave"
    base_url: str = "https://api.search.brave.com"


class TavilyConfig(_Web):
    """Tavily search API."""

    type: Literal["tavily"] = "tavily"
    base_url: str = "https://api.tavily.com"


class ExaConfig(_Web):
    """Exa search API."""

    type: Literal["exa"] = "exa"
    base_url: str = "https://api.exa.ai"


class SerpApiConfig(_Web):
    """SerpAPI (Google engine by default)."""

    type: Literal["serpapi"] = "serpapi"
    base_url: str = "https://serpapi.com"
    engine: str = Field(default="google", description="SerpAPI engine parameter")


ProviderConfig = Annotated[
    Union[BM25Config, LSAConfig, HybridConfig, DenseConfig, SyntheticConfig, SearxngConfig, BraveConfig, TavilyConfig,
          ExaConfig, SerpApiConfig],
    Field(discriminator="type"),
]
