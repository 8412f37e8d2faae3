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
