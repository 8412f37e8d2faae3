"""The loop's lease on a real redis-server: one holder at a time, renewed while held, given back at the end,
and a holder whose lease another took is told (and cannot delete the other's)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from services.loop.lease import Lease, lease_key

pytestmark = [pytest.mark.redis]


async def test_one_holder_at_a_time_renewed_released_and_lost(redis_url) -> None:
    key = lease_key(f"t{uuid.uuid4().hex[:8]}.", "router", "linear")
    a, b = Lease(redis_url, key, ttl_s=1.5), Lease(redis_url, key, ttl_s=1.5)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        async with a.hold(wait_s=5) as held_a:
            assert held_a and await a.holder() == a.token
            async with b.hold(wait_s=0) as held_b:  # held by a: b gives up at once
                assert not held_b
            # a's renewer keeps the key alive past its TTL while the block runs
            await asyncio.sleep(2.5)  # longer than the TTL: only the renewals keep it (a timer, not a sync wait)
            assert await a.holder() == a.token and not a.lost.is_set()
        assert await raw.get(key) is None  # given back at the block's end

        async with a.hold(wait_s=5) as held_a:
            assert held_a
            await raw.set(key, "someone-else", px=10_000)  # taken over (a's lease lapsed, another replica took it)
            await asyncio.wait_for(a.lost.wait(), timeout=5)  # the next renewal notices
        assert (await raw.get(key)) == b"someone-else"  # a's release did not delete the other's lease
        await raw.delete(key)

        async with b.hold(wait_s=5) as held_b:  # free again: b takes it
            assert held_b and await b.holder() == b.token
    finally:
        await a.close()
        await b.close()
        await raw.aclose()
