"""What the publisher keeps: blobs by sha256 on disk, manifests per version, stamps and serving pins.

Blobs and manifests live under ``storage_dir`` (the publisher is their only writer); the version
stamp and the samplers' serving reports are small shared state, so they live in Redis (or in
memory for unit tests and the embedded default).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from schemas.adapter import MODEL_ID_PATTERN, AdapterPublished
from schemas.base import content_id
from services.common.adapter_files import (
    SHA256_RE,
    HashMismatch,
)
from services.common.errors import FanrouteError

MODEL_ID_RE = re.compile(MODEL_ID_PATTERN)


class PublisherError(FanrouteError):
    """A request the publisher refuses; ``status`` and ``error`` become the HTTP answer."""

    status = 400
    error = "bad_request"


class BlobTooLarge(PublisherError, ValueError):
    """A blob over ``max_blob_bytes``."""

    status, error = 413, "body_too_large"


class MissingBlobs(PublisherError, LookupError):
    """A version names blobs that were never uploaded."""

    status, error = 409, "missing_blobs"

    def __init__(self, missing: dict[str, str]) -> None:
        super().__init__("blobs not uploaded yet (PUT /v1/blobs/{sha256} first): "
                         + ", ".join(f"{name}={sha}" for name, sha in sorted(missing.items())))
        self.missing = missing


class VersionTaken(PublisherError, ValueError):
    """A version number that already names other content (never overwritten)."""

    status, error = 409, "version_taken"


class NotFound(PublisherError, LookupError):
    """No such blob, model id, version or file."""

    status, error = 404, "not_found"


def check_sha256(sha: str) -> str:
    """``sha`` if it is 64 lowercase hex digits, else a clear error."""
    if not SHA256_RE.match(sha):
        raise PublisherError(f"not a sha256 (64 lowercase hex digits): {sha!r}")
    return sha


def check_model_id(model_id: str) -> str:
    """``model_id`` if it is safe as a directory name and a Redis key part."""
    if not MODEL_ID_RE.match(model_id):
        raise PublisherError(f"model id {model_id!r} must match {MODEL_ID_PATTERN}")
    return model_id


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- blobs


class BlobStore:
    """Files named by their sha256 under ``root/blobs/ab/abcd...``; writes are verified and atomic."""

    def __init__(self, root: Path) -> None:
        self.root = root / "blobs"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / check_sha256(sha)

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def missing(self, files: dict[str, str]) -> dict[str, str]:
        """The entries of ``files`` whose blob is not stored."""
        return {name: sha for name, sha in files.items() if not self.has(sha)}

    async def put(self, sha: str, chunks: AsyncIterator[bytes], max_bytes: int) -> bool:
        """Store the streamed bytes as ``sha``; True when new. Verified before it becomes visible."""
        dest = self.path(sha)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        h, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise BlobTooLarge(f"blob over {max_bytes} bytes")
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != sha:
                raise HashMismatch(f"body sha256 is {h.hexdigest()}, the path says {sha}")
            if dest.is_file():
                os.utime(dest)  # re-uploaded: young again, so the orphan sweep leaves it for its POST
                return False
            os.replace(tmp, dest)
            return True
        finally:
            Path(tmp).unlink(missing_ok=True)

    def shas(self) -> Iterator[str]:
        """Every stored blob's sha256."""
        for p in self.root.glob("??/*"):
            if SHA256_RE.match(p.name):
                yield p.name

    def delete_unreferenced(self, referenced: set[str], older_than_s: float) -> list[str]:
        """Delete blobs no manifest references and not touched for ``older_than_s``; their shas."""
        cutoff = time.time() - older_than_s
        gone = []
        for sha in list(self.shas()):
            p = self.path(sha)
            if sha not in referenced and p.stat().st_mtime <= cutoff:
                p.unlink(missing_ok=True)
                gone.append(sha)
        return gone


# --------------------------------------------------------------------------- manifests


class Manifest(BaseModel):
    """One published adapter version: its files by hash and what it was published with."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model_id: str
    version: int = Field(ge=1)
    base_model: str
    files_sha256: dict[str, str]
    files_bytes: dict[str, int]
    metrics: dict[str, float] = Field(default_factory=dict)
    run_id: str | None = None
    content_key: str
    published_at: datetime
    announced: bool = Field(default=False, description="The AdapterPublished message was acked")

    def message(self, url: str, *, promoted: bool = False, fallback_provider: str | None = None) -> AdapterPublished:
        """The ``adapters`` topic message announcing this version (``url`` = its manifest URL)."""
        return AdapterPublished(model_id=self.model_id, version=self.version, base_model=self.base_model,
                                url=url, files_sha256=self.files_sha256, published_at=self.published_at,
                                promoted=promoted, metrics=self.metrics, fallback_provider=fallback_provider)


def content_key(model_id: str, base_model: str, files: dict[str, str]) -> str:
    """What makes two posts the same version: model id, base model and the files' hashes."""
    return content_id("adapter-version", model_id, base_model, dict(sorted(files.items())))


class ManifestStore:
    """Manifests under ``root/adapters/<model_id>/v<version>.json`` and the promoted version."""

    def __init__(self, root: Path) -> None:
        self.root = root / "adapters"
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, model_id: str) -> Path:
        return self.root / check_model_id(model_id)

    def _path(self, model_id: str, version: int) -> Path:
        return self._dir(model_id) / f"v{version:08d}.json"

    def save(self, manifest: Manifest) -> None:
        _write_atomic(self._path(manifest.model_id, manifest.version), manifest.model_dump_json(indent=1).encode())

    def get(self, model_id: str, version: int) -> Manifest:
        path = self._path(model_id, version)
        try:
            return Manifest.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            raise NotFound(f"{model_id} has no version {version}") from None

    def versions(self, model_id: str) -> list[int]:
        """Stored versions of ``model_id``, oldest first."""
        return sorted(int(p.stem[1:]) for p in self._dir(model_id).glob("v*.json") if "." not in p.stem)

    def all(self, model_id: str) -> list[Manifest]:
        return [self.get(model_id, v) for v in self.versions(model_id)]

    def model_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def find(self, model_id: str, key: str) -> Manifest | None:
        """The stored version with this content key, if any."""
        return next((m for m in self.all(model_id) if m.content_key == key), None)

    def delete(self, model_id: str, version: int) -> None:
        self._path(model_id, version).unlink(missing_ok=True)
        self._promotion_path(model_id, version).unlink(missing_ok=True)

    def _promotion_path(self, model_id: str, version: int) -> Path:
        return self._dir(model_id) / f"v{version:08d}.promotion.json"

    def save_promotion(self, model_id: str, version: int, record: dict) -> None:
        """The promotion decision and its evidence, beside the version's manifest."""
        _write_atomic(self._promotion_path(model_id, version), json.dumps(record, indent=1, sort_keys=True).encode())

    def promotion(self, model_id: str, version: int) -> dict | None:
        try:
            return json.loads(self._promotion_path(model_id, version).read_bytes())
        except FileNotFoundError:
            return None

    def promoted(self, model_id: str) -> int | None:
        """The promoted version of ``model_id``, if one was promoted."""
        try:
            return int((self._dir(model_id) / "promoted").read_text())
        except FileNotFoundError:
            return None

    def set_promoted(self, model_id: str, version: int) -> None:
        _write_atomic(self._dir(model_id) / "promoted", str(version).encode())

    def referenced(self) -> set[str]:
        """Every blob sha256 some stored manifest names."""
        return {sha for mid in self.model_ids() for m in self.all(mid) for sha in m.files_sha256.values()}


def retention_victims(versions: Iterable[int], keep: int, pinned: set[int]) -> list[int]:
    """Versions to delete: all but the newest ``keep``, never a pinned one (promoted, served)."""
    ordered = sorted(versions)
    newest = set(ordered[-keep:])
    return [v for v in ordered if v not in newest and v not in pinned]
