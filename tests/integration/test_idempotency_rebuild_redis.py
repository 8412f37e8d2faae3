"""The key store on a real redis-server notices its marks vanish (FLUSHALL) and rebuilds them once, even
with many handlers asking at the same moment; a store nobody armed never rebuilds."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from services.common.idempotency import RedisKeyStore

pytestmark = [pytest.mark.redis]


async def test_marks_gone_are_rebuilt_once_before_any_answer(redis_url):
    store = RedisKeyStore(redis_url, f"rebuild-{uuid.uuid4().hex[:8]}")
    out = {f"k{i}" for i in range(10)}  # what the output topic holds
    calls = 0

    async def rebuild() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)  # let the other handlers pile up on the lock
        for key in out:
            await store.mark(key)
        return len(out)

    store.rebuild = rebuild
    for key in out:
        await store.mark(key)
    await store.arm()
    assert await store.seen("k1") and not await store.seen("new") and calls == 0
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(store.intact_key, *(f"{store.prefix}:done:{k}" for k in out))  # what FLUSHALL does here
        answers = await asyncio.gather(*(store.seen(f"k{i}") for i in range(10)), store.seen("new"))
        assert answers == [True] * 10 + [False] and calls == 1 and store.rebuilds == 1
        assert await client.exists(store.intact_key)
    finally:
        await client.aclose()
        await store.close()


async def test_an_unarmed_store_answers_from_its_marks_alone(redis_url):
    store = RedisKeyStore(redis_url, f"unarmed-{uuid.uuid4().hex[:8]}")
    store.rebuild = None
    try:
        await store.mark("a")
        assert await store.seen("a") and not await store.seen("b") and store.rebuilds == 0
    finally:
        await store.close()
