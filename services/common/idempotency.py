"""Idempotency keys for consumers: Redis in services, a dict in the in-memory default and tests."""

from __future__ import annotations

import abc


class KeyStore(abc.ABC):
    """Remembers which results were already produced, and sets of ids counted once."""

    @abc.abstractmethod
    async def seen(self, key: str) -> bool:
        """Whether ``key`` was marked."""

    @abc.abstractmethod
    async def mark(self, key: str) -> None:
        """Mark ``key`` as done."""

    @abc.abstractmethod
    async def add(self, set_name: str, member: str) -> None:
        """Add ``member`` to a set (idempotent: counting a replay twice changes nothing)."""

    @abc.abstractmethod
    async def count(self, set_name: str) -> int:
        """How many distinct members ``set_name`` has."""

    async def close(self) -> None:
        """Release connections."""


class MemoryKeyStore(KeyStore):
    """In-process store (lost on exit): the embedded default and unit tests."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.sets: dict[str, set[str]] = {}

    async def seen(self, key: str) -> bool:
        return key in self.keys

    async def mark(self, key: str) -> None:
        self.keys.add(key)

    async def add(self, set_name: str, member: str) -> None:
        self.sets.setdefault(set_name, set()).add(member)

    async def count(self, set_name: str) -> int:
        return len(self.sets.get(set_name, ()))


class RedisKeyStore(KeyStore):
    """Keys and sets in Redis under a prefix, shared by every replica of a consumer."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.prefix = prefix

    async def seen(self, key: str) -> bool:
        return bool(await self.client.exists(f"{self.prefix}:done:{key}"))

    async def mark(self, key: str) -> None:
        await self.client.set(f"{self.prefix}:done:{key}", b"1")

    async def add(self, set_name: str, member: str) -> None:
        await self.client.sadd(f"{self.prefix}:{set_name}", member)

    async def count(self, set_name: str) -> int:
        return int(await self.client.scard(f"{self.prefix}:{set_name}"))

    async def close(self) -> None:
        await self.client.aclose()


def key_store(url: str, prefix: str) -> KeyStore:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryKeyStore() if url == "memory://" else RedisKeyStore(url, prefix)
