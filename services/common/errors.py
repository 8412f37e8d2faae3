"""The one exception root of fanroute.

Every subclass also inherits the built-in it behaves like, so callers that only know the
standard library (``except ValueError``) still catch it.
"""

from __future__ import annotations


class FanrouteError(Exception):
    """Root of every error fanroute raises on purpose."""


class ConfigError(FanrouteError, ValueError):
    """A setting or config file is invalid; raised at start-up, never per message."""


class SchemaError(FanrouteError, ValueError):
    """A message on a topic does not match its schema."""


class UnknownSchemaVersion(SchemaError):
    """A message carries a ``schema_version`` this build does not read."""


class BusError(FanrouteError, ConnectionError):
    """Kafka did not accept or deliver a message."""


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
