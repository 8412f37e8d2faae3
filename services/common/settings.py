"""Settings shared by every service (env prefix ``FANROUTE_``, nested with ``__``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseModel):
    """How to reach the Kafka cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    bootstrap_servers: str = Field(default="127.0.0.1:9092", min_length=1,
                                   description="Comma-separated host:port list")
    client_id: str = Field(default="fanroute", min_length=1, max_length=128,
                           description="Client id prefix seen in broker logs")
    request_timeout_ms: int = Field(default=15_000, ge=1_000, le=300_000,
                                    description="Broker request timeout")
    publish_timeout_s: float = Field(default=5.0, gt=0, le=120,
                                     description="How long a publish may wait for acks=all")
    compression: Literal["none", "gzip", "lz4", "zstd", "snappy"] = Field(
        default="lz4", description="Producer compression of each record batch (lz4, zstd and snappy through "
                                   "cramjam); consumers read every codec whatever this is")
    max_batch_bytes: int = Field(
        default=524_288, ge=16_384, le=1_000_000,
        description="Most bytes in one partition's record batch. aiokafka's 16 KiB default sent one 20-50 KB "
                    "trace per request; under the broker's 1 MB message limit")
    linger_ms: int = Field(default=0, ge=0, le=1_000,
                           description="How long the producer waits to fill a batch before sending it; records "
                                       "queued behind an in-flight request are batched anyway")
    topic_namespace: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9._-]*$",
                                 description="Prefix for every topic name (tests use a fresh one)")
    ensure_topics: bool = Field(default=True,
                                description="Create registry topics with their partition counts at start")
    transient_backoff_initial_s: float = Field(
        default=0.25, gt=0, le=30,
        description="A handler that raised TransientError (or BusError) is retried in place after this "
                    "long the first time")
    transient_backoff_factor: float = Field(default=2.0, ge=1, le=10,
                                            description="Each further retry waits this many times longer")
    transient_backoff_max_s: float = Field(default=5.0, gt=0, le=60,
                                           description="No wait between transient retries is longer than this")
    transient_budget_s: float = Field(
        default=120.0, gt=0, le=270,
        description="After retrying one record this long the consumer gives up on it uncommitted (it is "
                    "redelivered, never dead-lettered); kept under Kafka's max.poll.interval.ms (300 s)")

    @model_validator(mode="after")
    def _backoff_cap_not_below_start(self) -> KafkaSettings:
        if self.transient_backoff_max_s < self.transient_backoff_initial_s:
            raise ValueError(f"transient_backoff_max_s ({self.transient_backoff_max_s}) is below "
                             f"transient_backoff_initial_s ({self.transient_backoff_initial_s})")
        return self


class RedisSettings(BaseModel):
    """How to reach Redis (version stamps, relay credentials, idempotency keys)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    url: str = Field(default="redis://127.0.0.1:6379/0", min_length=1, description="Redis URL")


class GcSettings(BaseModel):
    """The cyclic garbage collector's thresholds in a service process (Python's defaults are 700, 10, 10).

    Under load a request allocates thousands of short-lived objects, so at 700 the youngest generation is
    collected several times a request and the older ones often; ``bench/gateway_overhead.py`` measured
    the gateway's CPU per request about 13 % lower at the defaults below. Reference counting still frees
    almost everything at once; only cyclic garbage waits longer (a few MB at most)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    young: int = Field(default=20_000, ge=100, le=1_000_000,
                       description="Allocations (less deallocations) between collections of the youngest "
                                   "generation (Python: 700)")
    middle: int = Field(default=20, ge=1, le=1_000,
                        description="Youngest-generation collections between collections of the middle one "
                                    "(Python: 10)")
    old: int = Field(default=20, ge=1, le=1_000,
                     description="Middle-generation collections between full collections (Python: 10)")
    freeze: bool = Field(default=True,
                         description="Move what exists once the service is set up (modules, the app) out of "
                                     "the collector's reach, so full collections do not walk it again")


class ServiceSettings(BaseSettings):
    """Base class for a service's settings: Kafka, Redis and logging."""

    model_config = SettingsConfigDict(env_prefix="FANROUTE_", env_nested_delimiter="__",
                                      extra="ignore", frozen=True)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings, description="Kafka connection")
    redis: RedisSettings = Field(default_factory=RedisSettings, description="Redis connection")
    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$",
                           description="Root log level")
    event_loop: Literal["asyncio", "uvloop", "auto"] = Field(
        default="asyncio", description="The event loop: the standard one, uvloop (libuv; installed with "
                                       "uvicorn[standard]), or auto (uvloop where installed). The standard one "
                                       "is the default: the gateway spent as much or more CPU per request on "
                                       "uvloop (bench/gateway_overhead.py)")
    gc: GcSettings = Field(default_factory=GcSettings, description="The garbage collector's thresholds")


def secret_value(secret: SecretStr | None) -> str | None:
    """The secret's text, or None when it is unset or empty (an API key that is not there)."""
    return (secret.get_secret_value() if secret is not None else "") or None


def connection_env(settings: ServiceSettings) -> dict[str, str]:
    """``FANROUTE_KAFKA__*`` and ``FANROUTE_REDIS__*`` naming ``settings``' connections, for a child process
    (a service started by a composing command reads them as its own environment)."""
    env: dict[str, str] = {}
    for name in ("kafka", "redis"):
        for key, value in getattr(settings, name).model_dump(mode="json").items():
            env[f"FANROUTE_{name.upper()}__{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env
