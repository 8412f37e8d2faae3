"""The exception root and the schema errors, below every service so that ``schemas`` imports nothing
from ``services``; :mod:`services.common.errors` re-exports them beside the rest of the tree."""

from __future__ import annotations


class FanrouteError(Exception):
    """Root of every error fanroute raises on purpose."""


class SchemaError(FanrouteError, ValueError):
    """A message on a topic does not match its schema."""


class UnknownSchemaVersion(SchemaError):
    """A message carries a ``schema_version`` this build does not read."""
