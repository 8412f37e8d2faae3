"""Concurrent fan-out: per-provider timeouts, an overall deadline, errors become candidates."""

from __future__ import annotations

import asyncio
import time

from services.common.errors import ProviderRateLimited
from services.providers.fanout import fan_out
from tests.support.fakes import StaticProvider, failing
from tests.support.poll import eventually


async def test_all_providers_called_concurrently_in_config_order():
    gate = asyncio.Event()
    ps = [StaticProvider(f"p{i}", (f"u{i}",), gate=gate) for i in range(4)]
    task = asyncio.create_task(fan_out(ps, "q", deadline_s=5))
    await eventually(lambda: all(p.calls for p in ps), timeout_s=5, interval_s=0,
                     what="every provider entered before any answered")
    gate.set()
    out = await asyncio.wait_for(task, 5)
    assert [c.provider for c in out] == ["p0", "p1", "p2", "p3"]
    assert all(c.ok and c.citations[0].url == f"u{i}" for i, c in enumerate(out))


async def test_timeout_and_typed_errors_are_recorded_not_raised():
    ps = [StaticProvider("fast", ("u",)), StaticProvider("slow", ("u",), delay_s=5, timeout_s=0.05),
          failing("broken"), StaticProvider("limited", error=ProviderRateLimited("limited", 429, "slow down"))]
    out = {c.provider: c for c in await fan_out(ps, "q", deadline_s=5)}
    assert out["fast"].ok and out["fast"].cost_usd == 0.001
    assert out["slow"].error_kind == "timeout" and "0.05s" in out["slow"].error
    assert out["broken"].error_kind == "error" and "upstream exploded" in out["broken"].error
    assert out["limited"].error_kind == "rate_limited" and "429" in out["limited"].error
    assert all(out[n].cost_usd == 0 for n in ("slow", "broken", "limited"))


async def test_unexpected_exception_is_an_internal_error_candidate():
    out = await fan_out([StaticProvider("buggy", error=ZeroDivisionError("x"))], "q", deadline_s=1)
    assert out[0].error_kind == "internal" and "ZeroDivisionError" in out[0].error


async def test_overall_deadline_cuts_slow_providers():
    t0 = time.perf_counter()
    out = await fan_out([StaticProvider("a", ("u",)), StaticProvider("b", delay_s=10, timeout_s=30)],
                        "q", deadline_s=0.1)
    assert time.perf_counter() - t0 < 5
    assert out[0].ok and out[1].error_kind == "deadline"
