"""Wait for a condition by polling it: :func:`eventually` (in a test's event loop) and
:func:`eventually_sync` (in plain code). Tests synchronise on conditions through these, never on a
bare sleep.

The check returns its value when the condition holds (anything truthy: ``True``, a list of records,
...); that value is returned. Past the deadline the check runs one last time, then the wait fails
with an ``AssertionError`` that names what was awaited and shows the check's last value.
"""

from __future__ import annotations

import asyncio
import inspect
import reprlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 200


def _timed_out(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"timed out waiting for {what} (after {timeout_s:g}s; last check: {_short.repr(last)})")


async def eventually(check: Callable[[], T | Awaitable[T]], *, timeout_s: float, what: str,
                     interval_s: float = 0.1) -> T:
    """Call ``check`` (a plain or an async function) every ``interval_s`` until it returns something
    truthy, and return that; fail after ``timeout_s`` naming ``what``. ``interval_s=0`` only yields
    to the loop between checks (for conditions other tasks of the loop make true)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_try = time.monotonic() >= deadline
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if last_try:
            raise _timed_out(what, timeout_s, value)
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def eventually_sync(check: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """:func:`eventually` for code without an event loop (another process or thread makes it true)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_try = time.monotonic() >= deadline
        value = check()
        if value:
            return value
        if last_try:
            raise _timed_out(what, timeout_s, value)
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
