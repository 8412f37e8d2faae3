"""Does a LoRA adapter fit the base model it is about to be loaded into, module for module?

peft loads an adapter trained on another base without an error: weights for modules the base lacks are
dropped without a word, and modules the adapter has no weights for keep a fresh LoRA (B = 0) with only a
warning, which the sampler silences. A 20-layer student's adapter on the 30-layer base would then serve
a model nobody trained. So every loader checks first, from the adapter's own files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from services.common.errors import FanrouteError

#: What peft puts before a module's name in the adapter's saved keys.
SAVED_PREFIX = "base_model.model."


class AdapterMismatchError(FanrouteError, ValueError):
    """The adapter's LoRA weights and the base model's target modules are not the same set."""


def saved_modules(adapter_dir: Path) -> set[str]:
    """The module names an adapter directory holds LoRA weights for (``model.layers.0.self_attn.q_proj``)."""
    weights = adapter_dir / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            keys = list(f.keys())
    elif (adapter_dir / "adapter_model.bin").is_file():
        import torch

        keys = list(torch.load(adapter_dir / "adapter_model.bin", map_location="cpu", weights_only=True))
    else:
        raise AdapterMismatchError(f"{adapter_dir}: no adapter_model.safetensors or adapter_model.bin")
    return {k.split(".lora_")[0].removeprefix(SAVED_PREFIX) for k in keys if ".lora_" in k}


def target_modules(model: Any, targets: list[str] | str) -> set[str]:
    """The base model's modules a LoRA config targets, as peft matches them: a list entry is a module's
    name or its dotted ending (``q_proj``, ``self_attn.q_proj``), a string a regular expression over the
    whole name. A model that already holds adapters (peft's wrapped modules keep their names) gives the
    same set as the bare one."""
    names = (name.removeprefix(SAVED_PREFIX) for name, _ in model.named_modules())
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return {n for n in names if pattern.fullmatch(n)}
    return {n for n in names if any(n == t or n.endswith(f".{t}") for t in targets)}


def check_adapter_fits(model: Any, adapter_dir: str | Path) -> None:
    """Refuse (:class:`AdapterMismatchError`, naming an example) an adapter whose LoRA weights are not
    exactly for the modules of ``model`` that its config targets: trained on another base."""
    adapter_dir = Path(adapter_dir)
    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterMismatchError(f"{adapter_dir}: unreadable adapter_config.json: {exc}") from exc
    targets = config.get("target_modules")
    if not targets or any(config.get(k) for k in ("layers_to_transform", "exclude_modules", "target_parameters")):
        return  # nothing to match module names against, or peft narrows or widens the set itself
    saved, expected = saved_modules(adapter_dir), target_modules(model, targets)
    extra, missing = sorted(saved - expected), sorted(expected - saved)
    if extra or missing:
        parts = ([f"{len(extra)} weight(s) for modules this base lacks (e.g. {extra[0]})"] if extra else []) + (
            [f"no weights for {len(missing)} of its {len(expected)} target modules (e.g. {missing[0]})"]
            if missing else [])
        trained_on = config.get("base_model_name_or_path")
        raise AdapterMismatchError(f"{adapter_dir}: the adapter does not fit this base model (it was trained on "
                                   f"{trained_on!r}): " + "; ".join(parts))
