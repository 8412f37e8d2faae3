"""Export an adapter version: the PEFT directory as is, or merged into its base as a full checkpoint.

``python -m services.publisher export peft MODEL_ID VERSION OUT [--url URL]`` and
``python -m services.publisher export merged BASE_MODEL ADAPTER_DIR OUT``. torch is imported only
by the merged export.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.common.adapter_files import CHUNK, materialize
from services.publisher.store import BlobStore, Manifest, ManifestStore

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

    with model_loading():
        base = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **load_kw)
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


# --------------------------------------------------------------------------- command line


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``export peft ...`` / ``export merged ...`` (also wired as ``fanroute adapters export``)."""
    e = sub.add_parser("export", help="export an adapter version (PEFT directory or merged checkpoint)")
    kinds = e.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser("peft", help="the version's PEFT directory, as published")
    p.add_argument("model_id")
    p.add_argument("version", type=int)
    p.add_argument("out", type=Path, help="new directory to write")
    p.add_argument("--url", default=None,
                   help="a running publisher's base URL (default: read FANROUTE_STORAGE_DIR directly)")
    m = kinds.add_parser("merged", help="merge a PEFT directory into its base model (full checkpoint)")
    m.add_argument("base_model", type=Path, help="base model directory or .gguf file")
    m.add_argument("adapter_dir", type=Path, help="PEFT adapter directory (e.g. from `export peft`)")
    m.add_argument("out", type=Path, help="new directory to write")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``export`` command; a refused export is a message and exit 2."""
    from services.common.errors import FanrouteError

    try:
        if args.kind == "merged":
            out = export_merged(args.base_model, args.adapter_dir, args.out, dtype=args.dtype)
        elif args.url:
            from services.common.publisher_client import PublisherClient

            with PublisherClient(args.url) as client:
                out = client.fetch_version(args.model_id, args.version, args.out)
        else:
            from services.publisher.settings import PublisherSettings

            root = PublisherSettings().storage_dir
            out = export_peft(ManifestStore(root).get(args.model_id, args.version), BlobStore(root), args.out)
    except (FanrouteError, OSError) as exc:
        print(f"fanroute export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
