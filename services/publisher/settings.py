"""Publisher settings: where it listens, where blobs live, and what it keeps."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.common.settings import ServiceSettings


class PublisherSettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_STORAGE_DIR=/var/lib/fanroute/adapters``."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255, description="Listen address")
    port: int = Field(default=8010, ge=0, le=65535, description="Listen port (0 = any free port)")
    public_url: str = Field(default="http://127.0.0.1:8010", pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
                            max_length=512,
                            description="Base URL consumers reach this publisher at (goes into messages)")
    storage_dir: Path = Field(default=Path("out/publisher"),
                              description="Root of the blob store and the manifests")
    keep_versions: int = Field(default=5, ge=1, le=10_000,
                               description="Newest versions kept per model id (promoted and served ones "
                                           "are kept on top of these)")
    max_blob_bytes: int = Field(default=2 * 1024**3, ge=1024, le=64 * 1024**3,
                                description="Largest accepted file (blob)")
    max_json_bytes: int = Field(default=1_048_576, ge=1024, le=64 * 1024**2,
                                description="Largest JSON request body")
    serving_ttl_s: float = Field(default=300.0, gt=0, le=86_400,
                                 description="A sampler's serving report pins its version this long")
    stamp_check_s: float = Field(default=5.0, gt=0, le=3600,
                                 description="How often the stamps and promotions in Redis are checked against "
                                             "the manifests (and restored when Redis lost them)")
    orphan_grace_s: float = Field(default=3600.0, ge=0, le=30 * 86_400,
                                  description="An unreferenced blob younger than this is not deleted "
                                              "(it may be uploaded for a version not posted yet)")
