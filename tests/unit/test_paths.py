"""Every default path comes from services.common.paths and honours its variable, in every service.

The newcomer's crash this guards against: a settings module computed its default from ``Path.home()``
at import, ignored ``$FANROUTE_MODELS_DIR``, and the sampler looked for a model that was never there.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from services.common import paths

#: Every service's settings class (module, class); each is built from the environment alone.
SETTINGS = (
    ("services.gateway.settings", "GatewaySettings"),
    ("services.judge.settings", "JudgeSettings"),
    ("services.episodes.settings", "EpisodeSettings"),
    ("services.publisher.settings", "PublisherSettings"),
    ("services.sampler.settings", "SamplerSettings"),
    ("services.relay.settings", "RelaySettings"),
    ("services.rollouts.settings", "RolloutSettings"),
)


@pytest.fixture
def empty_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """``HOME`` and each path variable pointed at a distinct empty folder, no other FANROUTE_ setting."""
    import os

    for name in [n for n in os.environ if n.startswith("FANROUTE_")]:
        monkeypatch.delenv(name)  # e.g. the session's own FANROUTE_SPOOL_DIR (tests/conftest.py)
    folders = {name: tmp_path / name.lower() for name in ("HOME", *paths.PATH_VARIABLES)}
    for name, folder in folders.items():
        folder.mkdir()
        monkeypatch.setenv(name, str(folder))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return folders


def _settings_paths(obj, prefix: str = "") -> dict[str, Path]:
    """Every Path-valued field of a settings object (nested models too)."""
    from pydantic import BaseModel

    out: dict[str, Path] = {}
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        if isinstance(value, Path):
            out[prefix + name] = value
        elif isinstance(value, BaseModel):
            out.update(_settings_paths(value, f"{prefix}{name}."))
    return out


def test_every_default_lies_under_its_variable(empty_machine: dict[str, Path]) -> None:
    cache, models = empty_machine[paths.CACHE_DIR_ENV], empty_machine[paths.MODELS_DIR_ENV]
    judge, collections = empty_machine[paths.JUDGE_CACHE_DIR_ENV], empty_machine[paths.COLLECTIONS_DIR_ENV]
    from services.gateway.outbox import default_spool_dir
    from services.judge.backends.embed_cache import default_cache_path
    from services.models import prepare
    from services.providers import index
    from services.providers.collections import default_collections_dir

    expected_root = {
        "indexes": cache, "spool": cache, "sampler adapters": cache, "cache": cache, "models": models,
        "base model": models, "judge cache": judge, "collections": collections,
    }
    resolved = paths.resolved()
    assert set(resolved) == set(expected_root)
    for name, path in resolved.items():
        assert path.is_relative_to(expected_root[name]), (name, path)
    assert index.default_cache_dir() == cache / "indexes"
    assert default_spool_dir(None) == cache / "spool"
    assert default_cache_path().parent == judge
    assert prepare.default_base_dir() == models / paths.DEFAULT_BASE
    assert default_collections_dir() == collections


@pytest.mark.parametrize(("module", "cls"), SETTINGS, ids=[c for _, c in SETTINGS])
def test_service_settings_resolve_under_the_variables(module: str, cls: str, empty_machine: dict[str, Path]) -> None:
    """No service default reaches into ``HOME`` (or anywhere) when the variables say otherwise."""
    settings = getattr(importlib.import_module(module), cls)()
    found = _settings_paths(settings)
    if cls == "SamplerSettings":
        found["base_model"] = Path(settings.base_model)
    if cls == "RelaySettings":
        found["tokenizer"] = Path(settings.tokenizer)
    roots = tuple(empty_machine[v] for v in paths.PATH_VARIABLES)
    for name, path in found.items():
        if not path.is_absolute():
            continue  # a run directory relative to the working directory (out/...), not a cache
        assert not path.is_relative_to(empty_machine["HOME"]), (name, path)
        if path.is_relative_to(paths.REPO_ROOT):
            continue  # files of the checkout itself (the rollout harness)
        assert any(path.is_relative_to(r) for r in roots), (name, path)
    if cls == "SamplerSettings":
        assert Path(settings.base_model) == empty_machine[paths.MODELS_DIR_ENV] / paths.DEFAULT_BASE
        assert settings.adapter_cache_dir.is_relative_to(empty_machine[paths.CACHE_DIR_ENV])
    if cls == "RelaySettings":
        assert Path(settings.tokenizer) == empty_machine[paths.MODELS_DIR_ENV] / paths.DEFAULT_BASE


def test_a_variable_set_after_import_still_counts(empty_machine: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from services.sampler.settings import SamplerSettings

    later = tmp_path / "later-models"
    monkeypatch.setenv(paths.MODELS_DIR_ENV, str(later))
    assert SamplerSettings().base_model == str(later / paths.DEFAULT_BASE)


def test_home_and_xdg_are_the_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in paths.PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_root() == tmp_path / "home" / ".cache" / "fanroute"
    assert paths.models_dir() == tmp_path / "home" / ".cache" / "fanroute" / "models"
    assert paths.collections_dir() == paths.bundled_collections_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.judge_cache_dir() == tmp_path / "xdg" / "fanroute" / "judge"


def test_the_collections_ship_with_the_repository() -> None:
    """The embedded default is part of the checkout (no folder beside it is needed)."""
    root = paths.bundled_collections_dir()
    assert (root / "MANIFEST.md").is_file()
    from services.providers.config import ALL_COLLECTIONS

    for name in ALL_COLLECTIONS:
        assert (root / name / "qrels.tsv").is_file() and (root / name / "queries.jsonl").is_file(), name
        assert any((root / name / f).is_file() for f in ("corpus.jsonl", "corpus.jsonl.gz")), name
