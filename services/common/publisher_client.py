"""A synchronous client of the publisher: the trainer publishes with it, the sampler fetches with it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from services.common.adapter_files import CHUNK, HashMismatch, materialize, sha256_file
from services.common.errors import FanrouteError


class PublisherClientError(FanrouteError, RuntimeError):
    """The publisher refused a request or could not be reached; ``status`` is None when unreachable."""

    def __init__(self, message: str, *, status: int | None = None, error: str | None = None) -> None:
        super().__init__(message)
        self.status, self.error = status, error


class PublisherClient:
    """Talks to one publisher at ``base_url``; pass ``http`` to reuse (or fake) an httpx.Client."""

    def __init__(self, base_url: str, timeout_s: float = 60.0, *, http: httpx.Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self._owns_http = http is None

    def __enter__(self) -> PublisherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self.http.close()

    # ------------------------------------------------------------------ trainer side

    def publish(self, model_id: str, adapter_dir: Path, base_model: str, metrics: dict[str, float],
                *, run_id: str | None = None) -> dict[str, Any]:
        """Upload every file of ``adapter_dir`` as a blob, then post the version.

        Returns the AdapterPublished message as JSON (the same content again returns the existing
        version). The server refuses files that are not plain PEFT adapter files, naming them.
        """
        adapter_dir = Path(adapter_dir)
        files = {p.name: sha256_file(p) for p in sorted(adapter_dir.iterdir()) if p.is_file()}
        if not files:
            raise PublisherClientError(f"{adapter_dir}: no files to publish")
        for name, sha in files.items():
            with (adapter_dir / name).open("rb") as f:
                self._call("PUT", f"/v1/blobs/{sha}", content=f,
                           headers={"content-type": "application/octet-stream"})
        body = {"base_model": base_model, "files": files, "metrics": metrics, "run_id": run_id}
        return self._call("POST", f"/v1/adapters/{model_id}/versions", json=body).json()

    def promote(self, model_id: str, version: int, *, fallback_provider: str | None = None,
                evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        """Promote ``version`` (evidence stored beside it); returns the AdapterPublished message."""
        body = {"version": version, "fallback_provider": fallback_provider, "evidence": evidence}
        return self._call("POST", f"/v1/adapters/{model_id}/promote", json=body).json()

    def promoted(self, model_id: str) -> dict[str, Any] | None:
        """The promotion record (version, fallback_provider, evidence), or None before any promotion."""
        try:
            return self._call("GET", f"/v1/adapters/{model_id}/promoted").json()
        except PublisherClientError as exc:
            if exc.status == 404:
                return None
            raise

    def stamp(self, model_id: str) -> int:
        """The current version stamp of ``model_id`` (0 before the first publish)."""
        return int(self._call("GET", f"/v1/adapters/{model_id}/stamp").json()["stamp"])

    # ------------------------------------------------------------------ sampler side

    def versions(self, model_id: str) -> list[dict[str, Any]]:
        """Every stored version's manifest, oldest first."""
        return self._call("GET", f"/v1/adapters/{model_id}/versions").json()

    def manifest(self, model_id: str, version: int) -> dict[str, Any]:
        """One version's manifest (files_sha256, file_urls, base_model, metrics, promoted, ...)."""
        return self.fetch_manifest(f"{self.base_url}/v1/adapters/{model_id}/versions/{version}")

    def fetch_manifest(self, url: str) -> dict[str, Any]:
        """The manifest at ``url`` (the ``url`` field of an AdapterPublished message)."""
        return self._call("GET", url).json()

    def fetch_version(self, model_id: str, version: int, dest_dir: Path) -> Path:
        """Download a version into the new directory ``dest_dir``, verifying every file's sha256.

        A mismatch raises HashMismatch and leaves nothing at ``dest_dir``; a ``dest_dir`` that
        already holds exactly these files is returned untouched.
        """
        return self._fetch(self.manifest(model_id, version), Path(dest_dir))

    def fetch_url(self, url: str, dest_dir: Path, *, expect_sha256: dict[str, str] | None = None) -> Path:
        """Like :meth:`fetch_version` from a message's manifest ``url``; ``expect_sha256`` (the
        message's ``files_sha256``) must then equal the manifest's files."""
        manifest = self.fetch_manifest(url)
        if expect_sha256 is not None and manifest["files_sha256"] != expect_sha256:
            raise PublisherClientError(f"{url}: manifest files {manifest['files_sha256']} differ from "
                                       f"the announced {expect_sha256}")
        return self._fetch(manifest, Path(dest_dir))

    def fetch_file(self, manifest: dict[str, Any], name: str) -> bytes:
        """One file of a version (small ones: it is read into memory), its sha256 verified."""
        data = b"".join(self._stream(manifest["file_urls"][name]))
        if hashlib.sha256(data).hexdigest() != manifest["files_sha256"][name]:
            raise HashMismatch(f"{name}: sha256 differs from the manifest's")
        return data

    def _fetch(self, manifest: dict[str, Any], dest_dir: Path) -> Path:
        urls = manifest["file_urls"]
        return materialize(dest_dir, manifest["files_sha256"], lambda name, _sha: self._stream(urls[name]))

    def report_serving(self, sampler_id: str, model_id: str, version: int) -> dict[str, Any]:
        """Tell the publisher this sampler serves ``version`` (send it again before the TTL ends)."""
        body = {"sampler_id": sampler_id, "model_id": model_id, "version": version}
        return self._call("POST", "/v1/serving", json=body).json()

    # ------------------------------------------------------------------ plumbing

    def _stream(self, url: str) -> Iterator[bytes]:
        try:
            with self.http.stream("GET", url) as r:
                if r.is_error:
                    r.read()
                    self._raise(r)
                yield from r.iter_bytes(CHUNK)
        except httpx.HTTPError as exc:
            raise PublisherClientError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, url, **kw)
        except httpx.HTTPError as exc:
            raise PublisherClientError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if r.is_error:
            self._raise(r)
        return r

    @staticmethod
    def _raise(r: httpx.Response) -> None:
        try:
            body = r.json()
            error, reason = body.get("error"), body.get("reason", r.text)
        except ValueError:
            error, reason = None, r.text[:500]
        raise PublisherClientError(f"{r.request.method} {r.request.url}: HTTP {r.status_code} "
                                   f"{error or ''}: {reason}", status=r.status_code, error=error)
