"""Export an adapter version: the PEFT directory as is, or merged into its base as a full checkpoint.

The commands are in :mod:`services.publisher.cli`. torch is imported only by the merged export.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from services.common.adapter_files import CHUNK, materialize
from services.publisher.store import BlobStore, Manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def export_peft(manifest: Manifest, blobs: BlobStore, out_dir: Path) -> Path:
    """Write the version's PEFT directory (adapter_config.json, adapter_model.safetensors, ...) to
    the new directory ``out_dir``, verifying each file's hash on the way."""

    def read(_name: str, sha: str):
        with blobs.path(sha).open("rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    return materialize(Path(out_dir), manifest.files_sha256, read)


def export_merged(base_model_dir: Path, adapter_dir: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Merge the LoRA in ``adapter_dir`` into the base model and save a full checkpoint to ``out_dir``.

    ``base_model_dir`` is a Hugging Face model directory or a ``.gguf`` file (dequantised). The
    checkpoint is safetensors plus the tokenizer (the adapter's if it ships one, else the base's,
    if any). Written to a temporary sibling first, so a failure leaves nothing at ``out_dir``.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_model_dir, adapter_dir, out_dir = Path(base_model_dir), Path(adapter_dir), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; export into a new directory")
    load_kw = _gguf_kwargs(base_model_dir)
    source = base_model_dir.parent if "gguf_file" in load_kw else base_model_dir
    from services.common.hf import model_loading
    from services.models.adapters import check_adapter_fits

    with model_loading():
        base = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **load_kw)
        check_adapter_fits(base, adapter_dir)  # peft would merge another base's adapter without a word
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer = _tokenizer(adapter_dir, source, load_kw)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _gguf_kwargs(path: Path) -> dict[str, str]:
    return {"gguf_file": path.name} if path.suffix == ".gguf" else {}


def _tokenizer(adapter_dir: Path, base_source: Path, load_kw: dict[str, str]):
    """The adapter's tokenizer if saved beside it, else the base model's, else None."""
    from transformers import AutoTokenizer

    for source, kw in ((adapter_dir, {}), (base_source, load_kw)):
        if kw or any((source / n).is_file() for n in TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(source, **kw)
    return None
