"""The common retrying HTTP client's pure parts: Retry-After, redaction, backoff and the attempt loop.

The client's exchanges are tested through its users against real loopback servers
(tests/unit/test_web_providers.py, tests/unit/test_judge_http.py).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
from datetime import datetime, timedelta, timezone

import aiohttp
import pytest
from yarl import URL

from services.common.retry_http import (
    AttemptFailed,
    Backoff,
    Failure,
    SecretFilter,
    classify,
    is_transient_status,
    one_line,
    redact,
    retry_after_s,
    with_retries,
)


def test_retry_after_header_forms() -> None:
    soon = email.utils.format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)

    assert retry_after_s("2") == 2.0
    assert 28.0 < retry_after_s(soon) <= 30.0  # type: ignore[operator]
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # already past
    assert retry_after_s("soon") is None and retry_after_s(None) is None


def test_redact_blanks_raw_and_url_encoded_forms() -> None:
    key = "sk-S3CRET+key/=="
    text = f"raw {key} quoted sk-S3CRET%2Bkey%2F%3D%3D plus sk-S3CRET%2Bkey%2F%3D%3D&x=1"
    assert "S3CRET" not in redact(text, {key})
    assert redact("nothing here", {"", key}) == "nothing here"


def test_one_line_folds_redacts_then_cuts() -> None:
    assert one_line("  a\n\tb  ", 10) == "a b"
    assert one_line("x" * 20, 10) == "x" * 10 + " …"
    cut = one_line("y" * 8 + "KEY-1234567", 10, ("KEY-1234567", None))
    assert "KEY" not in cut and cut.startswith("y" * 8)


def test_secret_filter_redacts_log_lines_and_masks_query(caplog: pytest.LogCaptureFixture) -> None:
    secrets = SecretFilter()
    secrets.add("sk-abc")
    secrets.add(None)
    log = logging.getLogger("tests.retry_http.filter")
    log.addFilter(secrets)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            log.info("calling with %s", "sk-abc")
    finally:
        log.removeFilter(secrets)
    assert "sk-abc" not in caplog.text and "calling with ***" in caplog.text
    assert secrets.mask_query(URL("http://h/s?q=a&api_key=sk-abc")) == "http://h/s?q=a&api_key=***"


def test_statuses_backoff_and_failure_kinds() -> None:
    assert is_transient_status(429) and is_transient_status(503) and not is_transient_status(408)
    assert is_transient_status(408, {408, 409, 429}) and not is_transient_status(400, {408})
    backoff = Backoff(base_s=0.1, max_s=0.3)
    assert [backoff.delay(n) for n in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert backoff.delay(1, 30.0) == 30.0 and backoff.delay(1, -1.0) == 0.0
    assert Backoff(0.5, 60.0, max_wait_s=60.0).delay(1, 3600) == 60.0
    assert classify(TimeoutError()) is Failure.TIMEOUT
    assert classify(aiohttp.ServerDisconnectedError()) is Failure.BROKEN
    assert classify(aiohttp.ClientPayloadError("cut")) is Failure.BROKEN
    assert classify(aiohttp.TooManyRedirects(None, ())) is Failure.OTHER  # type: ignore[arg-type]
    assert classify(ValueError()) is None


async def test_with_retries_retries_until_success_and_reports() -> None:
    seen: list[tuple[str, int, float]] = []

    async def attempt(n: int) -> str:
        if n < 3:
            raise AttemptFailed(f"try {n}", wait_s=0.0 if n == 1 else None)
        return "ok"

    result = await with_retries(attempt, attempts=3, backoff=Backoff(0.01, 0.01),
                                on_failure=lambda n, f: seen.append(("failed", n, 0.0)),
                                on_retry=lambda n, f, d: seen.append(("retry", n, d)))
    assert result == ("ok", 3)
    assert seen == [("failed", 1, 0.0), ("retry", 1, 0.0), ("failed", 2, 0.0), ("retry", 2, 0.01)]


async def test_with_retries_raises_the_error_of_the_last_attempt() -> None:
    calls: list[int] = []

    async def attempt(n: int) -> None:
        calls.append(n)
        raise AttemptFailed(f"try {n}", error=KeyError(n))

    with pytest.raises(KeyError) as info:
        await with_retries(attempt, attempts=2, backoff=Backoff(0.0, 0.0))
    assert calls == [1, 2] and info.value.args == (2,) and info.value.__cause__ is None

    async def final(n: int) -> None:
        calls.append(n)
        raise AttemptFailed("no", retry=False)

    calls.clear()
    with pytest.raises(AttemptFailed, match="no"):
        await with_retries(final, attempts=5, backoff=Backoff(0.0, 0.0))
    assert calls == [1]


async def test_with_retries_stops_before_a_wait_past_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    calls: list[int] = []

    async def attempt(n: int) -> None:
        calls.append(n)
        raise AttemptFailed("busy", wait_s=30.0)

    with pytest.raises(AttemptFailed):
        await with_retries(attempt, attempts=5, backoff=Backoff(0.0, 0.0), deadline=loop.time() + 1.0)
    assert calls == [1]

    async def slow(n: int) -> None:
        await asyncio.sleep(5)

    with pytest.raises(TimeoutError):
        await with_retries(slow, attempts=5, backoff=Backoff(0.0, 0.0), deadline=loop.time() + 0.05)
