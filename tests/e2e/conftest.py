"""Fixtures of the end-to-end tests: a fresh machine (empty HOME and caches)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common import paths
from tests.support.tiny_model import build_tiny_model


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch) -> dict[str, Path]:
    """HOME and each cache variable at distinct empty folders; no other FANROUTE_ setting but the
    session's spool; the tiny model "prepared" where $FANROUTE_MODELS_DIR says, and nowhere else."""
    for name in [n for n in os.environ if n.startswith("FANROUTE_") and n != "FANROUTE_SPOOL_DIR"]:
        monkeypatch.delenv(name)  # the embedded default: the federated market, the bundled collections
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    folders = {name: tmp_path / "machine" / name.lower() for name in
               ("HOME", paths.CACHE_DIR_ENV, paths.MODELS_DIR_ENV, paths.JUDGE_CACHE_DIR_ENV)}
    for name, folder in folders.items():
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))
    build_tiny_model(paths.default_base_dir())
    assert paths.default_base_dir().is_relative_to(folders[paths.MODELS_DIR_ENV])
    return folders
