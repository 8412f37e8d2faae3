"""The exceptions of fanroute, under one root (:class:`schemas.errors.FanrouteError`).

Every subclass also inherits the built-in it behaves like, so callers that only know the
standard library (``except ValueError``) still catch it.
"""

from __future__ import annotations

# The root and the schema errors live in schemas (the lowest layer); every other error is here.
from schemas.errors import FanrouteError, SchemaError, UnknownSchemaVersion  # noqa: F401


class ConfigError(FanrouteError, ValueError):
    """A setting or config file is invalid; raised at start-up, never per message."""


class BusError(FanrouteError, ConnectionError):
    """Kafka did not accept or deliver a message."""


class TransientError(FanrouteError, ConnectionError):
    """A dependency (the publisher, Redis, ...) is briefly down: try the same work again later.

    A bus handler raises it to have its record retried in place with backoff, never dead-lettered
    (see ``services.common.bus``); anything else a handler raises counts as a failure of the record.
    """


class SandboxError(FanrouteError, OSError):
    """A rollout's sandbox could not be made or driven: a task image that will not build, a daemon that refuses a
    container. The rollout ends ``sandbox_failed`` with the harness_crashed terminal reward (an ``OSError``, as
    the other sandbox failures are)."""


class ProviderError(FanrouteError, RuntimeError):
    """A search provider failed to answer; the gateway records it on the candidate."""

    kind = "error"

    def __init__(self, provider: str, message: str) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.message = message


class ProviderTimeout(ProviderError, TimeoutError):
    """The provider did not answer within its timeout."""

    kind = "timeout"


class ProviderHTTPError(ProviderError):
    """The provider answered with an HTTP error status."""

    kind = "http_error"

    def __init__(self, provider: str, status: int, message: str) -> None:
        super().__init__(provider, f"HTTP {status}: {message}")
        self.status = status


class ProviderAuthError(ProviderHTTPError, PermissionError):
    """The provider refused our credentials (401/403)."""

    kind = "auth_error"


class ProviderRateLimited(ProviderHTTPError):
    """The provider said we are over quota (429)."""

    kind = "rate_limited"


class ProviderBadResponse(ProviderError, ValueError):
    """The provider answered 2xx with a body we cannot read."""

    kind = "bad_response"
