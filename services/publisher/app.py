"""The publisher's HTTP service: adapter files by content hash, versions, promotion, serving reports.

Each new version bumps the Redis version stamp and is announced on the ``adapters`` topic
(acks=all); consumers pull the files over HTTP from the manifest URL in the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field

from schemas.adapter import MODEL_ID_PATTERN, AdapterPublished
from schemas.topics import topic
from services.common.adapter_files import (
    ADAPTER_FILES,
    LINEAR_ARTIFACT,
    LINEAR_FILES,
    REQUIRED_FILES,
    SHA256_RE,
    AdapterFilesError,
    check_adapter_files,
)
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.http import BodyLimit, lifespan_of
from services.common.http import error as error_response
from services.common.openapi import PROMETHEUS, errors, install_contract, prometheus
from services.common.stamps import StampStore, stamp_key, stamp_store
from services.publisher.settings import PublisherSettings
from services.publisher.store import (
    BlobStore,
    Manifest,
    ManifestStore,
    MissingBlobs,
    NotFound,
    PublisherError,
    VersionTaken,
    content_key,
    retention_victims,
)

log = logging.getLogger(__name__)
ModelId = PathParam(pattern=MODEL_ID_PATTERN, description="The router's model id")
Sha256 = PathParam(pattern=SHA256_RE.pattern, description="The blob's sha256 (64 lowercase hex digits)")
#: The file list of a version as JSON Schema: a plain PEFT adapter's (or a linear router's) file names → sha256 (what
#: :func:`check_adapter_files` enforces, with 400 bad_files; the model keeps ``dict[str, str]`` so the
#: refusal names the file).
FILES_SCHEMA = {"anyOf": [{"propertyNames": {"enum": sorted(ADAPTER_FILES)}, "required": sorted(REQUIRED_FILES)},
                          {"propertyNames": {"enum": sorted(LINEAR_FILES)}, "required": [LINEAR_ARTIFACT]}],
                "additionalProperties": {"type": "string", "pattern": SHA256_RE.pattern}}
OCTET_BODY = {"requestBody": {"required": True, "description": "The blob's bytes",
                              "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}}


class Unavailable(PublisherError):
    """Kafka did not ack the announcement; what was stored stays stored and a retry re-announces."""

    status, error = 503, "bus_unavailable"


class VersionRequest(BaseModel):
    """A new adapter version: the blobs it consists of (uploaded before) and how it scored."""

    model_config = ConfigDict(extra="forbid")
    base_model: str = Field(min_length=1, max_length=512, description="Base model the LoRA applies to")
    files: dict[str, str] = Field(min_length=1, max_length=32, json_schema_extra=FILES_SCHEMA,
                                  description="File name → sha256 of its blob (a plain PEFT adapter: "
                                              "adapter_config.json and adapter_model.safetensors at least)")
    metrics: dict[str, float] = Field(default_factory=dict, max_length=256, description="Eval metrics")
    run_id: str | None = Field(default=None, min_length=1, max_length=256, description="Trainer run id")


class BlobStored(BaseModel):
    """A stored blob: its hash, and whether this request stored it (False: it was there)."""

    sha256: str
    created: bool


class PromoteRequest(BaseModel):
    """Which version becomes the one the gateway routes with."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1, description="An existing version")
    fallback_provider: str | None = Field(default=None, min_length=1, max_length=128,
                                          description="Best single provider measured beside it (routed fallback)")
    evidence: dict[str, Any] | None = Field(default=None, description="Why: the evaluation behind the "
                                                                       "decision, stored beside the manifest")


class ServingReport(BaseModel):
    """A sampler's heartbeat: it serves ``version`` of ``model_id`` (pins it against retention)."""

    model_config = ConfigDict(extra="forbid")
    sampler_id: str = Field(min_length=1, max_length=256, pattern=r"^[^\s:]+$", description="Sampler id")
    model_id: str = Field(pattern=MODEL_ID_PATTERN, description="The model id it serves")
    version: int = Field(ge=1, description="The version it serves")


class PublisherMetrics:
    """Prometheus counters of one publisher."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        c = lambda name, doc, *labels: Counter(name, doc, labels, registry=self.registry)  # noqa: E731
        self.blobs_stored = c("fanroute_publisher_blobs_stored_total", "New blobs stored")
        self.versions = c("fanroute_publisher_versions_published_total", "New adapter versions")
        self.promotions = c("fanroute_publisher_promotions_total", "Promotions announced")
        self.deleted_versions = c("fanroute_publisher_versions_deleted_total", "Versions removed by retention")
        self.deleted_blobs = c("fanroute_publisher_blobs_deleted_total", "Unreferenced blobs deleted")
        self.rejected = c("fanroute_publisher_rejected_total", "Refused requests", "reason")
        self.stamps_restored = c("fanroute_publisher_stamps_restored_total",
                                 "Stamps or promotions Redis had lost, put back from the manifests")


class Publisher:
    """Blob store, manifests, stamps and bus of one running publisher; the routes call into it."""

    def __init__(self, settings: PublisherSettings, bus: Bus, stamps: StampStore) -> None:
        self.settings = settings
        self.bus = bus
        self.stamps = stamps
        self.blobs = BlobStore(settings.storage_dir)
        self.manifests = ManifestStore(settings.storage_dir)
        self.metrics = PublisherMetrics()
        self.base_url = settings.public_url.rstrip("/")
        self._lock = asyncio.Lock()  # one writer of manifests; also keeps the sweep off a pending POST
        self._checker: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        await self.bus.start((topic("adapters"),))
        try:
            await self.reconcile()
        except Exception as exc:  # noqa: BLE001 - Redis not there yet: the periodic check catches up
            log.warning("stamp check at start failed (Redis unreachable?): %s", exc)
        self._checker = asyncio.create_task(self._reconcile_forever(), name="publisher:stamp-check")

    async def stop(self) -> None:
        """Stop the stamp check, then the bus and Redis.

        The check also watches ``_stopping``: a cancellation that lands inside a Redis call can be
        absorbed by the client, and a bare ``cancel()`` then left the loop sleeping forever (the
        shutdown hung). ``asyncio.wait`` does not re-raise the check's own CancelledError, so a
        cancellation of ``stop`` itself still propagates.
        """
        self._stopping.set()
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.wait({self._checker})
        await self.bus.stop()
        await self.stamps.close()

    def manifest_url(self, model_id: str, version: int) -> str:
        return f"{self.base_url}/v1/adapters/{model_id}/versions/{version}"

    async def put_blob(self, sha: str, chunks: AsyncIterator[bytes]) -> bool:
        """Store a blob (verified against ``sha``); True when it was new."""
        created = await self.blobs.put(sha, chunks, self.settings.max_blob_bytes)
        if created:
            self.metrics.blobs_stored.inc()
        return created

    async def publish(self, model_id: str, req: VersionRequest) -> tuple[AdapterPublished, bool]:
        """Stamp, store and announce a version; the same content again returns it (False = not new)."""
        check_adapter_files(req.files)
        key = content_key(model_id, req.base_model, req.files)
        async with self._lock:
            existing = self.manifests.find(model_id, key)
            if existing is not None:
                return await self._announce(existing), False
            missing = self.blobs.missing(req.files)
            if missing:
                raise MissingBlobs(missing)
            version = await self._next_version(model_id)
            manifest = Manifest(
                model_id=model_id, version=version, base_model=req.base_model, files_sha256=req.files,
                files_bytes={n: self.blobs.path(s).stat().st_size for n, s in req.files.items()},
                metrics=req.metrics, run_id=req.run_id, content_key=key, published_at=datetime.now(UTC))
            self.manifests.save(manifest)
            message = await self._announce(manifest)
            self.metrics.versions.inc()
            await self._retain(model_id)
        log.info("published %s v%d (%d files)", model_id, version, len(req.files))
        return message, True

    async def _next_version(self, model_id: str) -> int:
        """The stamp moved on by one, never onto a version this publisher already stored: after Redis
        lost the stamp (a restart without persistence, a FLUSHALL) ``incr`` would start again at 1 and
        name different content ``router@1``; the stamp is first raised to the newest stored version."""
        version = await self.stamps.incr(model_id)
        stored = set(self.manifests.versions(model_id))
        newest = max(stored, default=0)
        if version <= newest:
            log.warning("stamp of %s was %d but v%d is stored (Redis lost it): raised to %d", model_id,
                        version - 1, newest, newest)
            self.metrics.stamps_restored.inc()
            await self.stamps.raise_to(model_id, newest)
            version = await self.stamps.incr(model_id)
        if version in stored:
            raise VersionTaken(f"{model_id} v{version} already names other content; not overwritten")
        return version

    async def reconcile(self) -> int:
        """Put back what Redis lost from this publisher's own records: each model id's stamp (at least
        its newest stored version) and its promoted version. Returns how many keys were restored."""
        restored = 0
        for model_id in self.manifests.model_ids():
            newest = max(self.manifests.versions(model_id), default=0)
            if newest and await self.stamps.get(model_id) < newest:
                await self.stamps.raise_to(model_id, newest)
                restored += 1
            promoted = self.manifests.promoted(model_id)
            if promoted is not None and await self.stamps.promoted(model_id) is None:
                record = self.manifests.promotion(model_id, promoted) or {}
                await self.stamps.set_promoted(model_id, promoted, record.get("fallback_provider"))
                restored += 1
        if restored:
            self.metrics.stamps_restored.inc(restored)
            log.warning("restored %d adapter stamps/promotions in Redis from the publisher's manifests", restored)
        return restored

    async def _reconcile_forever(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):  # the interval passed without a stop: check again
                await asyncio.wait_for(self._stopping.wait(), self.settings.stamp_check_s)
            if self._stopping.is_set():
                return
            try:
                await self.reconcile()
            except Exception as exc:  # noqa: BLE001 - Redis away: the next round tries again
                log.warning("stamp check failed (Redis unreachable?): %s", exc)

    async def _announce(self, manifest: Manifest) -> AdapterPublished:
        """Publish the version's message unless Kafka already acked it; marks it announced."""
        message = manifest.message(self.manifest_url(manifest.model_id, manifest.version))
        if not manifest.announced:
            await self._send(message)
            self.manifests.save(manifest.model_copy(update={"announced": True}))
        return message

    async def _send(self, message: AdapterPublished) -> None:
        try:
            await self.bus.publish(topic("adapters"), message)
        except BusError as exc:
            raise Unavailable(f"{message.model_id} v{message.version} is stored but not announced "
                              f"({exc}); retry the same request") from exc

    async def promote(self, model_id: str, version: int, *, fallback_provider: str | None = None,
                      evidence: dict[str, Any] | None = None) -> AdapterPublished:
        """Store the evidence, announce ``version`` with promoted=True, then remember it (disk and Redis)."""
        async with self._lock:
            manifest = self.manifests.get(model_id, version)
            self.manifests.save_promotion(model_id, version, {
                "model_id": model_id, "version": version, "promoted_at": datetime.now(UTC).isoformat(),
                "fallback_provider": fallback_provider, "evidence": evidence})
            message = manifest.message(self.manifest_url(model_id, version), promoted=True,
                                       fallback_provider=fallback_provider)
            await self._send(message)
            self.manifests.set_promoted(model_id, version)
            await self.stamps.set_promoted(model_id, version, fallback_provider)
            self.metrics.promotions.inc()
        log.info("promoted %s v%d", model_id, version)
        return message

    async def report_serving(self, report: ServingReport) -> dict[str, Any]:
        """Pin the version a sampler serves for ``serving_ttl_s``."""
        self.manifests.get(report.model_id, report.version)  # 404 for an unknown version
        await self.stamps.report_serving(report.model_id, report.sampler_id, report.version,
                                         self.settings.serving_ttl_s)
        return {**report.model_dump(), "ttl_s": self.settings.serving_ttl_s}

    async def _retain(self, model_id: str) -> None:
        """Drop old versions (never the promoted or a served one), then blobs nobody references."""
        pinned = set((await self.stamps.serving(model_id)).values())
        promoted = self.manifests.promoted(model_id)
        if promoted is not None:
            pinned.add(promoted)
        victims = retention_victims(self.manifests.versions(model_id), self.settings.keep_versions, pinned)
        for v in victims:
            self.manifests.delete(model_id, v)
        gone = self.blobs.delete_unreferenced(self.manifests.referenced(), self.settings.orphan_grace_s)
        self.metrics.deleted_versions.inc(len(victims))
        self.metrics.deleted_blobs.inc(len(gone))
        if victims or gone:
            log.info("retention %s: removed versions %s and %d blobs (pinned %s)", model_id, victims,
                     len(gone), sorted(pinned))

    def describe(self, manifest: Manifest) -> dict[str, Any]:
        """A manifest as callers see it: files, hashes, sizes, URLs, and whether it is promoted."""
        url = self.manifest_url(manifest.model_id, manifest.version)
        return {**manifest.model_dump(mode="json", exclude={"content_key", "announced"}), "url": url,
                "promoted": self.manifests.promoted(manifest.model_id) == manifest.version,
                "file_urls": {n: f"{url}/files/{n}" for n in manifest.files_sha256}}

    def file_path(self, model_id: str, version: int, name: str) -> Any:
        manifest = self.manifests.get(model_id, version)
        if name not in manifest.files_sha256:
            raise NotFound(f"{model_id} v{version} has no file {name!r}")
        return self.blobs.path(manifest.files_sha256[name])


def create_app(settings: PublisherSettings, *, publisher: Publisher | None = None) -> FastAPI:
    """The FastAPI app; the bus connects in the lifespan, before serving."""
    pub = publisher or Publisher(settings, Bus(settings.kafka, client_id="fanroute-publisher"),
                                 stamp_store(settings.redis.url, settings.kafka.topic_namespace))

    app = FastAPI(title="fanroute publisher", version="0.1.0", lifespan=lifespan_of(pub),
                  description="Serves LoRA adapter files by content hash and announces versions.")
    app.state.publisher = pub
    app.add_middleware(BodyLimit, default=settings.max_json_bytes, prefixes={"/v1/blobs/": settings.max_blob_bytes},
                       on_reject=pub.metrics.rejected.labels("body_too_large").inc)

    @app.exception_handler(PublisherError)
    @app.exception_handler(AdapterFilesError)
    async def _refused(request: Request, exc: PublisherError | AdapterFilesError) -> JSONResponse:
        pub.metrics.rejected.labels(exc.error).inc()
        return error_response(exc.status, exc.error, str(exc))

    install_contract(app, on_reject=lambda kind: pub.metrics.rejected.labels(kind).inc(),
                     loc_with_source=True, body_limit=lambda path: (
                         settings.max_blob_bytes if path.startswith("/v1/blobs/") else settings.max_json_bytes))
    unknown_version = {404: "No such model id or version, named in the reason"}

    @app.put("/v1/blobs/{sha256}", status_code=201, response_model=BlobStored, openapi_extra=OCTET_BODY,
             responses={200: {"description": "Already stored", "model": BlobStored},
                        **errors({400: "Body does not hash to the path (hash_mismatch)",
                                  413: f"Over max_blob_bytes ({settings.max_blob_bytes} bytes)"})})
    async def put_blob(request: Request, response: Response, sha256: str = Sha256) -> Any:
        """Store the body as the blob ``sha256`` (refused unless it hashes to it); idempotent."""
        created = await pub.put_blob(sha256, request.stream())
        response.status_code = 201 if created else 200
        return {"sha256": sha256, "created": created}

    @app.get("/v1/blobs/{sha256}", response_class=FileResponse, responses={
        200: {"description": "The blob's bytes", "content": {"application/octet-stream": {}}},
        **errors({404: "No such blob"})})
    async def get_blob(sha256: str = Sha256) -> FileResponse:
        """The blob's bytes."""
        return _file(pub.blobs.path(sha256))

    @app.post("/v1/adapters/{model_id}/versions", status_code=201, response_model=AdapterPublished,
              responses={200: {"description": "Same content posted before: the existing version",
                               "model": AdapterPublished},
                         **errors({400: "Not plain PEFT adapter files (bad_files)",
                                   409: "Blobs not uploaded, named in the reason (missing_blobs)",
                                   503: "Stored but Kafka did not ack; retry (bus_unavailable)"})})
    async def post_version(req: VersionRequest, response: Response, model_id: str = ModelId) -> Any:
        """Publish a version made of uploaded blobs: stamp, manifest, ``adapters`` message."""
        message, created = await pub.publish(model_id, req)
        response.status_code = 201 if created else 200
        return message

    @app.get("/v1/adapters/{model_id}/versions")
    async def list_versions(model_id: str = ModelId) -> list[dict[str, Any]]:
        """Every stored version of ``model_id``, oldest first."""
        return [pub.describe(m) for m in pub.manifests.all(model_id)]

    @app.get("/v1/adapters/{model_id}/versions/{version}", responses=errors(unknown_version))
    async def get_version(version: int, model_id: str = ModelId) -> dict[str, Any]:
        """One version's manifest."""
        return pub.describe(pub.manifests.get(model_id, version))

    @app.get("/v1/adapters/{model_id}/versions/{version}/files/{name}", response_class=FileResponse, responses={
        200: {"description": "The file's bytes", "content": {"application/octet-stream": {}}},
        **errors({404: "No such version, or no such file in it"})})
    @app.get("/v1/adapters/{model_id}/versions/{version}/{name}", response_class=FileResponse,
             include_in_schema=False)  # ``<message url>/<file name>``, as plain HTTP fetchers pull
    async def get_file(version: int, name: str, model_id: str = ModelId) -> FileResponse:
        """One file of a version, by name (also at ``<manifest url>/<name>``)."""
        return _file(pub.file_path(model_id, version, name))

    @app.get("/v1/adapters/{model_id}/stamp")
    async def get_stamp(model_id: str = ModelId) -> dict[str, Any]:
        """The current version stamp in Redis (0 before the first publish)."""
        return {"model_id": model_id, "stamp": await pub.stamps.get(model_id),
                "key": stamp_key(settings.kafka.topic_namespace, model_id)}

    @app.post("/v1/adapters/{model_id}/promote", response_model=AdapterPublished, responses=errors({
        **unknown_version, 503: "Kafka did not ack the announcement; retry (bus_unavailable)"}))
    async def promote(req: PromoteRequest, model_id: str = ModelId) -> Any:
        """Make ``version`` the promoted one and announce it (promoted=True)."""
        return await pub.promote(model_id, req.version, fallback_provider=req.fallback_provider,
                                 evidence=req.evidence)

    @app.get("/v1/adapters/{model_id}/promoted", responses=errors({404: "No promoted version"}))
    async def promoted(model_id: str = ModelId) -> dict[str, Any]:
        """The promoted version with its fallback provider and the evidence it was promoted on (404: none)."""
        version = pub.manifests.promoted(model_id)
        if version is None:
            raise NotFound(f"{model_id} has no promoted version")
        return pub.manifests.promotion(model_id, version) or {"model_id": model_id, "version": version}

    @app.get("/v1/adapters/{model_id}/serving")
    async def serving(model_id: str = ModelId) -> dict[str, int]:
        """Sampler id → the version it reported serving (unexpired reports only)."""
        return await pub.stamps.serving(model_id)

    @app.post("/v1/serving", responses=errors(unknown_version))
    async def report_serving(report: ServingReport) -> dict[str, Any]:
        """A sampler's heartbeat; the version it serves survives retention while reports keep coming."""
        return await pub.report_serving(report)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "storage_dir": str(settings.storage_dir),
                "kafka": "memory" if pub.bus.in_memory else settings.kafka.bootstrap_servers}

    @app.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
    async def metrics() -> Response:
        return prometheus(pub.metrics.registry)

    return app


def _file(path: Any) -> FileResponse:
    if not path.is_file():
        raise NotFound(f"no blob {path.name}")
    return FileResponse(path, media_type="application/octet-stream")

