"""A mark that fails while Redis is down is remembered: the retried record sees its key as done
(so its result is not published twice), and the mark reaches Redis once it answers."""

from __future__ import annotations

import pytest
import redis.exceptions as rx

from services.common.errors import TransientError
from services.common.idempotency import RedisKeyStore


class FlakyRedis:
    """A Redis client stand-in whose server is down for the first ``down`` calls."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.keys: set[str] = set()

    def _call(self) -> None:
        if self.down > 0:
            self.down -= 1
            raise rx.ConnectionError("Connection closed by server.")

    async def set(self, key: str, value: bytes) -> None:
        self._call()
        self.keys.add(key)

    async def exists(self, key: str) -> int:
        self._call()
        return int(key in self.keys)

    async def get(self, key: str) -> bytes | None:
        self._call()
        return b"1" if key in self.keys else None

    async def mget(self, *keys: str) -> list[bytes | None]:
        self._call()
        return [b"1" if k in self.keys else None for k in keys]

    async def aclose(self) -> None:
        pass


async def test_a_failed_mark_is_seen_on_the_retry_and_written_when_redis_is_back():
    store = RedisKeyStore("redis://127.0.0.1:1/0", "p")
    await store.close()
    store.client = FlakyRedis(down=2)
    with pytest.raises(TransientError):
        await store.mark("v1")  # the result is out; Redis went down before the mark
    with pytest.raises(TransientError):
        await store.seen("v1")  # the retry, Redis still down: still transient, never "not seen"
    assert await store.seen("v1") is True  # Redis is back: seen, and the mark is written now
    assert store.client.keys == {"p:done:v1"} and store.unmarked == set()
    assert await store.seen("v2") is False
