"""The exact mean of several LoRA adapters' weight deltas, as one LoRA adapter of N times the rank.

A LoRA adapter adds ``s · B A`` to each target weight (``s = alpha / r``). Putting the adapters' ``A``
factors one above the other and their ``B`` factors (each divided by N) side by side gives one adapter
whose delta is the mean of theirs, with rank ``N · r`` and ``alpha`` scaled by N so ``s`` is unchanged.
No SVD, no approximation; merged into the weights it costs nothing at serving time. Used by
``bench/sft_recipes.py`` (``--average-passes``, ``--soup``) to average passes of one training run or
draws of one recipe.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: Config fields the adapters must share for their deltas to be averaged this way.
SAME = ("peft_type", "target_modules", "r", "lora_alpha", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
        "layers_to_transform", "rank_pattern", "alpha_pattern", "modules_to_save")


class AverageError(ValueError):
    """Adapters that cannot be averaged this way, with the reason."""


def average_adapters(dirs: Sequence[Path], out: Path) -> Path:
    """Write to ``out`` the adapter whose delta is the mean of ``dirs``' deltas; returns ``out``.

    Files beside the weights (e.g. ``top_tier_rates.json``) are copied from the first adapter."""
    import torch
    from safetensors.torch import load_file, save_file

    if not dirs:
        raise AverageError("no adapters to average")
    configs = [json.loads((Path(d) / CONFIG).read_text()) for d in dirs]
    first = configs[0]
    for d, cfg in zip(dirs, configs, strict=True):
        differ = [k for k in SAME if _norm(cfg.get(k)) != _norm(first.get(k))]
        if differ:
            raise AverageError(f"{d}: {', '.join(differ)} differ from {dirs[0]}'s")
    if first.get("use_dora") or first.get("use_rslora") or first.get("rank_pattern") or first.get("alpha_pattern"):
        raise AverageError(f"{dirs[0]}: DoRA, rsLoRA and per-module ranks are not averaged by stacking factors")
    weights = [load_file(str(Path(d) / WEIGHTS)) for d in dirs]
    n = len(dirs)
    if any(set(w) != set(weights[0]) for w in weights):
        raise AverageError("the adapters hold different weight names")
    merged: dict[str, torch.Tensor] = {}
    for key in weights[0]:
        parts = [w[key] for w in weights]
        if ".lora_A." in key:
            merged[key] = torch.cat(parts, dim=0).contiguous()  # (N·r, in)
        elif ".lora_B." in key:
            merged[key] = torch.cat([p / n for p in parts], dim=1).contiguous()  # (out, N·r)
        else:
            raise AverageError(f"{key}: only LoRA A/B factors can be averaged this way")
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(dirs[0]).iterdir():
        if f.is_file() and f.name not in (CONFIG, WEIGHTS):
            shutil.copy2(f, out / f.name)
    config = {**first, "r": first["r"] * n, "lora_alpha": first["lora_alpha"] * n}
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(merged, str(out / WEIGHTS))
    return out


def _norm(value: object) -> object:
    """Lists compared as sets (target module order does not matter), everything else as is."""
    return sorted(value) if isinstance(value, list) else value
