"""Checkpoints: adapter, optimizer, scheduler, RNG states, step and data order — enough to resume exactly.

Layout: ``<output_dir>/checkpoints/step_<N>/`` with ``adapter/`` (peft's files), ``state.pt``
(optimizer, scheduler, RNG) and ``progress.json`` (step, batch order, config fingerprint). A
checkpoint is written to a temporary directory and renamed, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.common.files import atomic_dir

CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class Progress:
    """Where a run stood at a checkpoint."""

    step: int
    batches: list[list[int]]
    fingerprint: dict[str, Any]


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if (p / "progress.json").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = checkpoint_dirs(output_dir)
    return found[-1] if found else None


def due(every: int, step: int, last: int) -> bool:
    """Whether a periodic action (checkpoint, eval) runs after ``step``: every ``every`` steps (0 = never),
    but not after the last step, whose save and eval every run does anyway."""
    return bool(every) and step % every == 0 and step < last


def after_step(step: int, last: int, checkpoint_every: int, eval_every: int,
               save: Callable[[int], object], evaluate: Callable[[int], object]) -> None:
    """The periodic checkpoint and eval after ``step`` (:func:`due`), in that order."""
    if due(checkpoint_every, step, last):
        save(step)
    if due(eval_every, step, last):
        evaluate(step)


def at_end(start: int, last: int, save: Callable[[int], object], evaluate: Callable[[int], object]) -> None:
    """The last step's checkpoint (unless the run resumed at its end: nothing new to save) and eval."""
    if start < last:
        save(last)
    evaluate(last)


def resumable(output_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None: a fresh start); refuses a resume with nothing to resume and a
    fresh start over someone's checkpoints, so a run never silently continues or clobbers another."""
    latest = latest_checkpoint(output_dir)
    if resume and latest is None:
        raise ConfigError(f"resume asked but {output_dir} has no checkpoint")
    if not resume and latest is not None:
        raise ConfigError(f"{output_dir} already holds checkpoints ({latest.name}); pass --resume or use another "
                          "output_dir")
    return latest


def rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states."""
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(output_dir: Path, model: Any, optimizer: Any, scheduler: Any, progress: Progress,
                    keep: int) -> Path:
    """Write checkpoint ``step_<N>`` atomically and prune to the newest ``keep``."""
    import torch

    root = Path(output_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{progress.step}"
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp / "adapter")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()},
                   tmp / "state.pt")
        (tmp / "progress.json").write_text(json.dumps(
            {"step": progress.step, "batches": progress.batches, "fingerprint": progress.fingerprint}) + "\n")
    for old in checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_progress(path: Path) -> Progress:
    """The step, batch order and fingerprint stored in a checkpoint."""
    raw = json.loads((Path(path) / "progress.json").read_text())
    return Progress(int(raw["step"]), [list(b) for b in raw["batches"]], raw["fingerprint"])


def check_fingerprint(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """A resume must train the same thing: differing settings are a ConfigError naming them."""
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if differ:
        detail = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
        hint = "; the training episodes differ (resume with the same --as-of or file)" if "data" in differ else ""
        raise ConfigError(f"cannot resume from {path}: settings changed ({detail}){hint}")


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any) -> Progress:
    """Load adapter weights, optimizer, scheduler and RNG from ``path`` into the live objects."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = Path(path) / "adapter"
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"checkpoint {path} has no adapter weights")
    result = set_peft_model_state_dict(model, load_file(weights))
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise ConfigError(f"checkpoint {path}: adapter weights do not fit the model ({missing[:3]})")
    state = torch.load(Path(path) / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return read_progress(path)
