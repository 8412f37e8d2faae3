"""The ``adapters`` consumer and the adapter puller: announcement → download over HTTP → verify → load.

A version is pulled into ``<cache>/<model_id>/<version>/`` through a *fetcher* (the publisher's
client when it is installed, plain HTTP file downloads otherwise; tests inject their own), into a
temporary dir first; every file is then hashed against the announcement, and only a dir that
verifies is renamed into place and loaded. A mismatch deletes the download and names the file.

A source that cannot be reached (connection refused, timeout, HTTP 5xx) raises
:class:`SourceUnreachable`, a :class:`~services.common.errors.TransientError`: the bus retries
the announcement in place until the publisher is back, instead of dead-lettering it. A refusal
(HTTP 4xx) or a hash mismatch stays a permanent :class:`AdapterUnavailable` (dead-lettered with
its reason).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from schemas.adapter import AdapterPublished, parse_versioned, versioned_name
from services.common.adapter_files import artifact_kind
from services.common.errors import TransientError
from services.sampler.registry import (
    AdapterConflict,
    AdapterEntry,
    AdapterError,
    AdapterIntegrityError,
    AdapterRegistry,
    AdapterUnavailable,
    safe_relative,
    verify_files,
)

log = logging.getLogger(__name__)
VERIFIED_MARKER = ".fanroute-verified.json"


class SourceUnreachable(AdapterUnavailable, TransientError):
    """The publisher (or the announced file server) could not be reached or answered 5xx: try later."""


def is_unreachable(exc: BaseException) -> bool:
    """Whether a fetch failed because its source is briefly down (not because it refused or lied).

    Walks the exception's causes: a connect/read timeout or network error, an HTTP 5xx (from the
    publisher client or a plain download), or a TransientError count; an HTTP 4xx, a hash
    mismatch or anything else does not.
    """
    import httpx

    from services.common.publisher_client import PublisherClientError

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, PublisherClientError) and cur.status is not None:
            return cur.status >= 500
        if isinstance(cur, httpx.HTTPStatusError):
            return cur.response.status_code >= 500
        if isinstance(cur, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError,
                            TransientError, ConnectionError, TimeoutError)):
            return True
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return False


class Fetcher(Protocol):
    """Download ``model_id@version`` into ``dest_dir`` and return the adapter dir (blocking; run in a thread).

    ``files_sha256`` is None when the version was never announced here: the fetcher must then get
    and check the file list itself (the publisher client does).
    """

    def __call__(self, model_id: str, version: int, url: str | None, files_sha256: dict[str, str] | None,
                 dest_dir: Path) -> Path: ...


def http_file_fetcher(timeout_s: float) -> Fetcher:
    """A fetcher that GETs ``<url>/<file name>`` for every announced file (needs the announcement)."""

    def fetch(model_id: str, version: int, url: str | None, files_sha256: dict[str, str] | None,
              dest_dir: Path) -> Path:
        import httpx

        if not url or not files_sha256:
            raise AdapterUnavailable(f"{versioned_name(model_id, version)}: no announcement with a URL and "
                                     "file list, and no publisher client to ask")
        with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
            for name in files_sha256:
                target = dest_dir / safe_relative(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                with client.stream("GET", f"{url.rstrip('/')}/{quote(name)}") as resp:
                    resp.raise_for_status()
                    with target.open("wb") as f:
                        for chunk in resp.iter_bytes():
                            f.write(chunk)
        return dest_dir

    return fetch


def default_fetcher(publisher_url: str | None, timeout_s: float, *, client: Any = None) -> Fetcher:
    """The publisher's client when a publisher URL is set (it checks the manifest and every hash
    itself), else plain HTTP downloads of the announced files (``<message url>/<file name>``)."""
    if not publisher_url:
        return http_file_fetcher(timeout_s)
    if client is None:
        from services.common.publisher_client import PublisherClient

        client = PublisherClient(publisher_url, timeout_s)

    def fetch(model_id: str, version: int, url: str | None, files_sha256: dict[str, str] | None,
              dest_dir: Path) -> Path:
        if url and files_sha256:  # announced: the manifest must list exactly the announced files
            return Path(client.fetch_url(url, dest_dir, expect_sha256=files_sha256))
        return Path(client.fetch_version(model_id, version, dest_dir))

    return fetch


class AdapterStore:
    """The local cache of pulled versions: download into a temp dir, verify, rename into place."""

    def __init__(self, root: Path, fetcher: Fetcher) -> None:
        self.root = root
        self.fetcher = fetcher

    def dir_for(self, model_id: str, version: int) -> Path:
        return self.root / quote(model_id, safe="") / str(version)

    def pull(self, model_id: str, version: int, url: str | None, files_sha256: dict[str, str] | None) -> Path:
        """A verified local dir for ``model_id@version`` (reused when already pulled); blocking."""
        final = self.dir_for(model_id, version)
        if (final / VERIFIED_MARKER).is_file():
            held = self._marker(final).get("files_sha256")
            if files_sha256 is None or held is None or held == files_sha256:
                return final
            raise AdapterConflict(f"{model_id}@{version} is announced with other files than the ones verified "
                                  f"here ({_differ(held, files_sha256)}): two contents under one name, refused")
        partial = final.parent / f".partial-{version}-{uuid.uuid4().hex[:8]}"
        partial.mkdir(parents=True)
        try:
            got = Path(self.fetcher(model_id, version, url, files_sha256, partial))
            if got.resolve() != partial.resolve():  # a fetcher may put the files elsewhere
                shutil.copytree(got, partial, dirs_exist_ok=True)
            if files_sha256 is not None:
                verify_files(partial, files_sha256)
            (partial / VERIFIED_MARKER).write_text(json.dumps(
                {"model_id": model_id, "version": version, "url": url, "files_sha256": files_sha256}))
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        finally:
            if partial.exists():
                shutil.rmtree(partial, ignore_errors=True)
        return final

    def remove_partials(self) -> int:
        """Delete the temporary dirs of pulls that never finished (a sampler killed mid-pull leaves
        one); call at start, before this process pulls anything. Returns how many went."""
        stale = list(self.root.glob("*/.partial-*"))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return len(stale)

    def scan(self) -> list[tuple[str, int, Path]]:
        """Every verified version already in the cache, as (model_id, version, dir)."""
        found = []
        for marker in self.root.glob(f"*/*/{VERIFIED_MARKER}"):
            meta = self._marker(marker.parent)
            if isinstance(meta.get("model_id"), str) and isinstance(meta.get("version"), int):
                found.append((meta["model_id"], meta["version"], marker.parent))
        return sorted(found, key=lambda t: (t[0], t[1]))

    def held_hashes(self, model_id: str, version: int) -> dict[str, str] | None:
        """The files' hashes of ``model_id@version`` as verified in the cache, or None."""
        final = self.dir_for(model_id, version)
        return self._marker(final).get("files_sha256") if (final / VERIFIED_MARKER).is_file() else None

    @staticmethod
    def _marker(path: Path) -> dict:
        try:
            return json.loads((path / VERIFIED_MARKER).read_text())
        except (OSError, ValueError):
            return {}


class SamplerLike(Protocol):
    """What the worker needs from the sampler: its registry and a way to check + load an adapter."""

    registry: AdapterRegistry

    async def register(self, entry: AdapterEntry) -> None: ...


class AdapterWorker:
    """Keeps the registry in step with the ``adapters`` topic, and pulls unknown versions on demand."""

    def __init__(self, sampler: SamplerLike, store: AdapterStore, *, publisher_url: str | None = None,
                 accept_base_models: tuple[str, ...] = ()) -> None:
        self.sampler = sampler
        self.store = store
        self.publisher_url = publisher_url
        self.accept_base_models = accept_base_models
        self._locks: dict[str, asyncio.Lock] = {}

    def restore(self) -> int:
        """Register the versions already verified in the cache (after a restart), after removing what
        unfinished pulls left; returns how many were registered."""
        reg = self.sampler.registry
        if removed := self.store.remove_partials():
            log.info("removed %d unfinished pulls from %s", removed, self.store.root)
        found = self.store.scan()
        for model_id, version, path in found:
            reg.add(AdapterEntry(versioned_name(model_id, version), path, model_id=model_id, version=version))
            if version >= (reg.newest_version(model_id) or 0):
                reg.point_alias(model_id, versioned_name(model_id, version))
        return len(found)

    async def handle(self, msg: AdapterPublished) -> None:
        """One announcement: remember it; if it is the newest version of its model id, pull, load, re-alias."""
        if artifact_kind(msg.files_sha256) != "lora":
            log.info("ignoring %s@%d: a linear router (the gateway serves it in-process), not a LoRA adapter",
                     msg.model_id, msg.version)
            return
        if self.accept_base_models and msg.base_model not in self.accept_base_models:
            log.warning("ignoring %s@%d: base %r is not one of %s", msg.model_id, msg.version, msg.base_model,
                        self.accept_base_models)
            return
        held = self.store.held_hashes(msg.model_id, msg.version)
        if held is not None and held != dict(msg.files_sha256):
            metrics = getattr(self.sampler, "metrics", None)
            if metrics is not None:
                metrics.adapter_events.labels("conflict").inc()
            log.error("refusing %s@%d: announced with other files than the ones served here (%s)", msg.model_id,
                      msg.version, _differ(held, dict(msg.files_sha256)))
            raise AdapterConflict(f"{msg.model_id}@{msg.version} is announced with other files than the ones "
                                  f"served here ({_differ(held, dict(msg.files_sha256))}): two contents under "
                                  "one name, refused (dead-lettered with this reason)")
        reg = self.sampler.registry
        reg.announce(msg)
        newest = reg.newest_version(msg.model_id)
        if newest is not None and msg.version < newest:
            log.info("%s@%d announced after @%d: kept for on-demand use", msg.model_id, msg.version, newest)
            return
        await self.ensure(versioned_name(msg.model_id, msg.version))

    async def ensure(self, requested: str) -> AdapterEntry:
        """The adapter serving ``requested``, pulling it first if needed; AdapterUnavailable if it cannot be."""
        reg = self.sampler.registry
        entry = reg.resolve(requested)
        if entry is not None:
            return entry
        target = self._target(requested)
        if target is None:
            raise AdapterUnavailable(f"The model `{requested}` does not exist: no adapter of that name is "
                                     "loaded, announced or fetchable")
        model_id, version = target
        lock = self._locks.setdefault(versioned_name(model_id, version), asyncio.Lock())
        async with lock:
            entry = reg.get(versioned_name(model_id, version))
            if entry is None:
                entry = await self._pull_and_load(model_id, version)
        return entry

    def _target(self, requested: str) -> tuple[str, int] | None:
        """(model_id, version) that ``requested`` names and that we have a way to fetch."""
        reg = self.sampler.registry
        parsed = parse_versioned(requested)
        if parsed is not None:
            if reg.announcement(*parsed) is not None or self.publisher_url:
                return parsed
            return None
        latest = reg.announcement(requested)
        return (requested, latest.version) if latest is not None else None

    async def _pull_and_load(self, model_id: str, version: int) -> AdapterEntry:
        reg = self.sampler.registry
        name = versioned_name(model_id, version)
        msg = reg.announcement(model_id, version)
        try:
            path = await asyncio.to_thread(self.store.pull, model_id, version, msg.url if msg else None,
                                           dict(msg.files_sha256) if msg else None)
        except (AdapterIntegrityError, AdapterConflict) as exc:
            log.error("refusing %s: %s", name, exc)
            raise AdapterUnavailable(f"{name}: download refused, not loaded: {exc}") from exc
        except AdapterUnavailable as exc:
            if isinstance(exc, TransientError) or not is_unreachable(exc):
                raise
            raise SourceUnreachable(f"{name}: source unreachable (try again later): {exc}") from exc
        except Exception as exc:
            if is_unreachable(exc):  # the bus logs each retry
                raise SourceUnreachable(f"{name}: source unreachable (try again later): {type(exc).__name__}: "
                                        f"{exc}") from exc
            raise AdapterUnavailable(f"{name}: could not be fetched: {type(exc).__name__}: {exc}") from exc
        entry = AdapterEntry(name, path, model_id=model_id, version=version)
        try:
            await self.sampler.register(entry)  # checks the dir and makes it resident
        except AdapterError as exc:  # verified bytes, unusable adapter: do not keep it for a restart
            await asyncio.to_thread(shutil.rmtree, path, True)
            raise AdapterUnavailable(f"{name}: pulled but not loadable: {exc}") from exc
        if version >= (reg.newest_version(model_id) or 0):
            reg.point_alias(model_id, name)
        log.info("adapter %s ready from %s (alias %s → %s)", name, path, model_id, reg.alias_target(model_id))
        return entry


def _differ(held: dict[str, str], announced: dict[str, str]) -> str:
    """Which files differ, by name and short hash."""
    names = sorted(n for n in set(held) | set(announced) if held.get(n) != announced.get(n))
    return ", ".join(f"{n}: {str(held.get(n))[:12]} here, {str(announced.get(n))[:12]} announced" for n in names)


__all__ = ["AdapterStore", "AdapterWorker", "Fetcher", "SamplerLike", "SourceUnreachable", "default_fetcher",
           "http_file_fetcher", "is_unreachable"]
