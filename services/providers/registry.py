"""Build a provider object from its config (dispatch on the config's ``type``)."""

from __future__ import annotations

from pathlib import Path

from services.providers import config as c
from services.providers.base import Provider


def build_provider(cfg: c.ProviderConfig, *, collections_dir: Path | None = None,
                   cache_dir: Path | None = None) -> Provider:
    """One provider instance; nothing is loaded until its ``start()``."""
    from services.providers import local, web

    if isinstance(cfg, c.HybridConfig):
        return local.HybridProvider(cfg, collections_dir=collections_dir, cache_dir=cache_dir)
    if isinstance(cfg, c.LSAConfig):
        return local.LSAProvider(cfg, collections_dir=collections_dir, cache_dir=cache_dir)
    if isinstance(cfg, c.BM25Config):
        return local.BM25Provider(cfg, collections_dir=collections_dir, cache_dir=cache_dir)
    if isinstance(cfg, c.DenseConfig):
        return local.DenseProvider(cfg, collections_dir=collections_dir, cache_dir=cache_dir)
    if isinstance(cfg, c.SyntheticConfig):
        return local.SyntheticProvider(cfg)
    web_classes = {c.SearxngConfig: web.SearxngProvider, c.BraveConfig: web.BraveProvider,
                   c.TavilyConfig: web.TavilyProvider, c.ExaConfig: web.ExaProvider,
                   c.SerpApiConfig: web.SerpApiProvider}
    return web_classes[type(cfg)](cfg)
