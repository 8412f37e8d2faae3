"""Provider markets: named sets of local providers over the bundled collections.

``federated`` (the embedded default) is modelled on federated search / resource selection
(CORI, ReDDE, the TREC FedWeb tracks): one *vertical* per domain of the collections' MANIFEST
that indexes its domain deeply (full text, BM25 fused with LSA, BM25 settings chosen on that
domain's tuning-half queries) at a low price, and two *generalists* that cover every collection
but shallowly (title and the first 300 characters of each document, one method each) at a higher
price. That is the shape of a real market: PubMed-, arXiv- or patent-style vertical APIs are cheap
or free and deep in their field and useless outside it; general web-search APIs answer anything
from a shallow crawl of everything and charge per query. Routing pays when the query names its
domain: the vertical is better *and* cheaper than the generalist there.

``nested`` is the market of the first releases, kept as the control: every specialist indexes a
subset of the collections with the same methods as a generalist, so ``bm25-all`` is nearly always
as good, and a router has nothing to win (the promotion rule must refuse there).

Costs are per call in USD; latency is a simulated network latency (log-normal) added to the real
compute. ``fanroute market`` prints each market's quality and cost table against the qrels.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import TypeAdapter, ValidationError

from schemas.base import summarise
from services.common.errors import ConfigError
from services.providers.config import (
    BM25Config,
    DenseConfig,
    HybridConfig,
    LatencyModel,
    LSAConfig,
    ProviderConfig,
)

MarketName = Literal["federated", "nested"]
MARKETS: tuple[MarketName, ...] = ("federated", "nested")
DEFAULT_MARKET: MarketName = "federated"

#: The domains of ``data/collections/MANIFEST.md`` (its "clearly distinct domains"), each
#: with the collections that belong to it.
DOMAINS: dict[str, tuple[str, ...]] = {
    "aero": ("cranfield",),
    "compsci": ("cacm",),
    "physics": ("npl",),
    "biomed": ("med", "scifact"),
    "libsci": ("adi", "cisi", "lisa"),
}
GENERALIST_LEAD_CHARS = 300


@dataclass(frozen=True)
class Vertical:
    """One vertical's settings. ``k1``/``b``/``lsa_weight`` were chosen per domain on the *tuning* half of
    its dev queries only (``python -m bench.market_tune``); the validation half never chose anything."""

    domain: str
    k1: float
    b: float
    lsa_weight: float
    cost_usd: float
    median_ms: float


VERTICALS: tuple[Vertical, ...] = (  # from `python bench/market_tune.py` (tuning half; docs/markets.md has its output)
    Vertical("aero", k1=1.5, b=0.4, lsa_weight=1.0, cost_usd=0.0010, median_ms=90),
    Vertical("compsci", k1=0.9, b=0.75, lsa_weight=0.2, cost_usd=0.0010, median_ms=80),
    Vertical("physics", k1=1.2, b=0.4, lsa_weight=0.6, cost_usd=0.0008, median_ms=80),
    Vertical("biomed", k1=0.9, b=0.75, lsa_weight=0.6, cost_usd=0.0015, median_ms=110),
    Vertical("libsci", k1=2.0, b=0.4, lsa_weight=0.4, cost_usd=0.0008, median_ms=90),
)


def vertical(v: Vertical) -> HybridConfig:
    """The provider config of one vertical: full text of its domain, BM25 + LSA."""
    return HybridConfig(name=v.domain, collections=DOMAINS[v.domain], k1=v.k1, b=v.b, lsa_weight=v.lsa_weight,
                        cost_usd=v.cost_usd, latency=LatencyModel(median_ms=v.median_ms, sigma=0.25))


def federated() -> list[ProviderConfig]:
    """Five deep, cheap verticals and two broad, shallow, dearer generalists."""
    return [
        *(vertical(v) for v in VERTICALS),
        BM25Config(name="web-lexical", lead_chars=GENERALIST_LEAD_CHARS, k1=1.2, b=0.75, cost_usd=0.0030,
                   latency=LatencyModel(median_ms=220, sigma=0.3)),
        LSAConfig(name="web-semantic", lead_chars=GENERALIST_LEAD_CHARS, dim=200, cost_usd=0.0040,
                  latency=LatencyModel(median_ms=280, sigma=0.35)),
    ]


def nested() -> list[ProviderConfig]:
    """The first releases' five providers: specialists nested inside the generalists."""
    return [
        BM25Config(name="bm25-all", cost_usd=0.001, latency=LatencyModel(median_ms=120, sigma=0.3)),
        DenseConfig(name="dense-all", cost_usd=0.004, latency=LatencyModel(median_ms=300, sigma=0.4)),
        DenseConfig(name="bio-dense", collections=("med", "scifact"), cost_usd=0.002,
                    latency=LatencyModel(median_ms=150, sigma=0.3)),
        BM25Config(name="lib-bm25", collections=("cisi", "lisa", "adi"), cost_usd=0.0005,
                   latency=LatencyModel(median_ms=60, sigma=0.2)),
        BM25Config(name="eng-bm25", collections=("cranfield", "npl"), cost_usd=0.0005,
                   latency=LatencyModel(median_ms=60, sigma=0.2)),
    ]


def market(name: MarketName) -> list[ProviderConfig]:
    """The providers of market ``name``."""
    return {"federated": federated, "nested": nested}[name]()


def domain_of(collection: str) -> str:
    """The domain a collection belongs to (KeyError for an unknown one)."""
    return next(d for d, cols in DOMAINS.items() if collection in cols)


def default_providers() -> list[ProviderConfig]:
    """The embedded default: the ``federated`` market (see :func:`federated`)."""
    return market(DEFAULT_MARKET)


def providers_in_force(providers: list[ProviderConfig], *, explicit: bool, providers_file: Path | None,
                       market_name: MarketName) -> list[ProviderConfig]:
    """The file's providers if one is named, else an explicitly given list, else the market preset's."""
    if providers_file is not None:
        return load_providers_file(providers_file)
    return providers if explicit else market(market_name)


_PROVIDERS = TypeAdapter(list[ProviderConfig])


def load_providers_file(path: Path) -> list[ProviderConfig]:
    """Read ``providers`` from a TOML or JSON file; errors name the file and the field."""
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        entries = data["providers"] if isinstance(data, dict) else data
    except (OSError, KeyError, ValueError) as exc:  # TOML/JSON errors name the line and column
        raise ConfigError(f"{path}: cannot read providers: {exc}") from exc
    try:
        return _PROVIDERS.validate_python(entries)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid providers: {summarise(exc)} (paths are providers[i].field)") from exc
