"""The judge is not a provider: refuse a judge whose model or endpoint is one being judged.

Self-preference compounds over N arms: a judge that is also a provider (or shares a provider's
model, or sits behind the same endpoint) flatters that provider, and the router learns the flattery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from services.common.errors import ConfigError
from services.judge.base import JudgeIdentity
from services.providers.config import ProviderConfig

if TYPE_CHECKING:
    from services.judge.settings import JudgeSettings


def _host(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    return f"{(parts.hostname or '').lower()}:{port}"


def provider_identities(cfg: ProviderConfig) -> set[str]:
    """What identifies a provider: its name and its endpoint host."""
    ids = {f"name:{cfg.name.lower()}"}
    base = getattr(cfg, "base_url", None)
    if base:
        ids.add(f"endpoint:{_host(base)}")
    return ids


def judge_identities(identity: JudgeIdentity) -> set[str]:
    """What identifies the judge: its model name (compared with provider names) and endpoint."""
    ids = {f"name:{identity.model.lower()}"}
    if identity.endpoint:
        ids.add(f"endpoint:{_host(identity.endpoint)}")
    return ids


def check_not_a_provider(identity: JudgeIdentity, providers: list[ProviderConfig]) -> None:
    """Raise :class:`ConfigError` naming the clash if the judge is one of ``providers``.

    (A local judge that shares a dense provider's embedding model is refused separately:
    ``services.judge.backends.local.conflicting_providers``.)
    """
    mine = judge_identities(identity)
    for cfg in providers:
        if not cfg.enabled:
            continue
        clash = mine & provider_identities(cfg)
        if clash:
            what = ", ".join(sorted(clash))
            raise ConfigError(f"the judge ({identity.kind} {identity.model}) is provider {cfg.name!r} "
                              f"({what}); a judge must have no arm in the race — pick another judge "
                              "or drop that provider from the judged set")


def guard(settings: JudgeSettings) -> None:
    """Refuse (ConfigError) when the configured judge is one of the judged providers: by name or
    endpoint (any judge), or by sharing a dense provider's embedding model (local judge)."""
    from services.judge.settings import build_backend
    from services.judge.settings_local import LocalJudgeConfig

    check_not_a_provider(build_backend(settings.judge).identity, settings.providers)
    if isinstance(settings.judge, LocalJudgeConfig) and settings.judge.use_embeddings:
        from services.judge.backends.local import conflicting_providers

        clash = conflicting_providers(settings.judge, settings.providers)
        if clash:
            raise ConfigError(f"the local judge embeds with the same model as provider(s) {clash}; "
                              "it would flatter them — use the lexical local judge "
                              "(FANROUTE_JUDGE='{\"type\": \"local\"}') or another judge")


def provider_hosts(settings: JudgeSettings) -> tuple[str, ...]:
    """Hosts of web providers' endpoints: scrubbed from anything the judge reads."""
    hosts = (urlsplit(getattr(p, "base_url", "") or "").hostname for p in settings.providers)
    return tuple(h for h in hosts if h)
