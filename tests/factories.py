"""Moved to :mod:`tests.support.records`; this re-export stays only until the modules that another
engineer owns right now (tests/unit/test_bus_transient.py) import from there. Do not add users."""

from tests.support.records import NOW, trace

__all__ = ["NOW", "trace"]
