"""The adapter directory contract: which files a published router version may hold, their hashes, and
how a consumer materialises them (verified, all or nothing).

Two kinds of router are published the same way: a PEFT LoRA adapter (served by the sampler or vLLM)
and a linear router (one JSON artifact, served in-process by the gateway); the file set says which.

Shared by the publisher (checks uploads), its client (pulls versions) and the sampler (verifies
what it pulled).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from services.common.errors import FanrouteError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
REQUIRED_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})
#: The top-tier table the router decides with (services/router/rates.py), written beside the adapter by
#: the trainer; a version without it decides by the first choice.
RATES_FILE = "top_tier_rates.json"
#: What a PEFT adapter directory may hold: the adapter, its card, its top-tier table, and the tokenizer
#: saved beside it. No pickles (``.bin``): a consumer should never have to unpickle what it pulled.
ADAPTER_FILES = REQUIRED_FILES | frozenset({
    RATES_FILE, "README.md", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
})
#: A linear router version: its JSON artifact (services/router/linear.py) and, optionally, a card.
LINEAR_ARTIFACT = "linear_router.json"
#: what a served version is made of (a LoRA adapter's two files, or a linear router's artifact)
SERVED_FILES = REQUIRED_FILES | {LINEAR_ARTIFACT}
LINEAR_FILES = frozenset({LINEAR_ARTIFACT, "README.md"})
CHUNK = 1 << 20
#: The response header in which a sampler names the content (:func:`content_digest`) of the adapter that
#: answered; the gateway records it on routed traces, the relay on calls. vLLM sends none (then: None).
ADAPTER_SHA256_HEADER = "x-fanroute-adapter-sha256"


def artifact_kind(files: Iterable[str]) -> str:
    """``linear`` for a linear router's file set, else ``lora`` (a PEFT adapter)."""
    return "linear" if LINEAR_ARTIFACT in set(files) else "lora"


class AdapterFilesError(FanrouteError, ValueError):
    """An adapter's file list or bytes are not acceptable; ``status``/``error`` become an HTTP answer."""

    status = 400
    error = "bad_request"


class BadAdapterFiles(AdapterFilesError):
    """The file list is not a plain PEFT adapter directory."""

    error = "bad_files"


class HashMismatch(AdapterFilesError):
    """Bytes whose sha256 is not the one they were announced with."""

    error = "hash_mismatch"


def content_digest(files_sha256: Mapping[str, str]) -> str:
    """What an adapter *is*: the sha256 over its config's and weights' hashes — or a linear router's artifact's
    (``name=sha`` lines, sorted).

    A card or tokenizer beside them changes nothing served, so they are left out: a manifest's digest
    (from its ``files_sha256``) equals the digest of the directory a sampler loaded it from."""
    lines = "".join(f"{name}={files_sha256[name]}\n" for name in sorted(SERVED_FILES & files_sha256.keys()))
    return hashlib.sha256(lines.encode()).hexdigest()


def dir_digest(path: Path) -> str:
    """:func:`content_digest` of the adapter files in directory ``path``, hashed from disk."""
    return content_digest({name: sha256_file(path / name) for name in SERVED_FILES if (path / name).is_file()})


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_adapter_files(files: dict[str, str]) -> None:
    """Refuse anything but a plain PEFT adapter's (or a linear router's) file names with well-formed hashes."""
    linear = artifact_kind(files) == "linear"
    allowed = LINEAR_FILES if linear else ADAPTER_FILES
    bad = sorted(n for n in files if n not in allowed)
    if bad:
        why = "path separators are not allowed" if any("/" in n or "\\" in n for n in bad) else "unknown"
        kind = "linear router" if linear else "plain PEFT adapter"
        raise BadAdapterFiles(f"files {bad}: not {kind} files ({why}); allowed: {sorted(allowed)}")
    missing = sorted(REQUIRED_FILES - files.keys()) if not linear else []
    if missing:
        raise BadAdapterFiles(f"an adapter needs {missing} (or {LINEAR_ARTIFACT}, for a linear router)")
    for name, sha in files.items():
        if not SHA256_RE.match(sha):
            raise BadAdapterFiles(f"files.{name}: not a sha256 (64 lowercase hex digits): {sha!r}")


def materialize(dest: Path, files: dict[str, str], read: Callable[[str, str], Iterable[bytes]]) -> Path:
    """Write ``files`` (name → sha256) into the new directory ``dest``, verifying every hash.

    ``read(name, sha)`` yields the file's bytes. Files land in a temporary sibling directory that
    is renamed to ``dest`` only when all of them verify, so a failure leaves nothing behind. An
    empty ``dest`` is filled (replaced by the rename); one that already holds exactly these files
    is returned as is; any other existing ``dest`` is refused.
    """
    check_adapter_files(files)
    if dest.exists() and any(dest.iterdir()):
        if _holds_exactly(dest, files):
            return dest
        raise FileExistsError(f"{dest} exists and does not hold exactly these files; remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    try:
        for name, sha in sorted(files.items()):
            h = hashlib.sha256()
            with (tmp / name).open("wb") as f:
                for chunk in read(name, sha):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != sha:
                raise HashMismatch(f"{name}: received bytes hash to {h.hexdigest()}, expected {sha}; "
                                   f"nothing was written to {dest}")
        os.rename(tmp, dest)  # POSIX: replaces an empty directory atomically
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _holds_exactly(directory: Path, files: dict[str, str]) -> bool:
    present = {p.name for p in directory.iterdir()}
    return present == set(files) and all(sha256_file(directory / n) == s for n, s in files.items())
