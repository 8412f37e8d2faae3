"""Idempotency keys for consumers: Redis in services, a dict in the in-memory default and tests.

Redis being unreachable is a :class:`~services.common.errors.TransientError` (see
:func:`redis_transient`): a bus handler that hits it has its record retried, not dead-lettered.

A consumer marks a key after its result is out (published). If that mark fails because Redis is
down, the key store remembers the key in the process and :meth:`KeyStore.seen` reports it as seen
(writing the mark again first), so the retried record does not publish its result a second time
(the fault matrix's Redis rows, ``tests/integration/test_fault_redis.py``). A process that dies
before the mark is covered by the consumers' ``reconcile`` from the topic at start.

Redis that *forgets* (``FLUSHALL``, a restart without persistence) would let a replayed record through
again. A consumer that hands the store its ``reconcile`` as :attr:`KeyStore.rebuild` and calls
:meth:`KeyStore.arm` after its start-up reconcile is protected: the store keeps an ``intact`` key beside
the marks, read in the same round trip as each mark; when it is gone the marks are rebuilt from the
output topic (once, under a lock) before the answer is given
(``tests/integration/test_fault_redis_flush_consumers.py``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

from services.common.errors import TransientError

log = logging.getLogger(__name__)


def is_redis_unavailable(exc: BaseException) -> bool:
    """A Redis connection or timeout error (server down, restarting, loading, network)."""
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:  # pragma: no cover - redis is a core dependency
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


@contextlib.contextmanager
def redis_transient(what: str) -> Iterator[None]:
    """Re-raise a Redis connection/timeout error inside the block as TransientError naming ``what``."""
    try:
        yield
    except TransientError:
        raise
    except Exception as exc:
        if is_redis_unavailable(exc):
            raise TransientError(f"{what}: Redis unavailable: {type(exc).__name__}: {exc}") from exc
        raise


class KeyStore(abc.ABC):
    """Remembers which results were already produced, and sets of ids counted once."""

    #: Marks every result already on the consumer's output topic (its ``reconcile``); returns how many.
    rebuild: Callable[[], Awaitable[int]] | None = None
    rebuilds = 0  # how many times the marks were found gone and rebuilt

    async def arm(self) -> None:
        """The marks are complete (the start-up reconcile ran): from now on, notice if they vanish."""

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
        self.intact_key = f"{prefix}:intact"
        self.unmarked: set[str] = set()  # done here, but the mark did not reach Redis (yet)
        self._rebuilding = asyncio.Lock()

    async def arm(self) -> None:
        with redis_transient("idempotency key store"):
            await self.client.set(self.intact_key, b"1")

    async def seen(self, key: str) -> bool:
        if key in self.unmarked:  # its result is out; only the mark is missing: write it, report seen
            await self.mark(key)
            return True
        with redis_transient("idempotency key store"):
            done, intact = await self.client.mget(f"{self.prefix}:done:{key}", self.intact_key)
        if intact is None and self.rebuild is not None:
            await self._rebuild()
            with redis_transient("idempotency key store"):
                done = await self.client.get(f"{self.prefix}:done:{key}")
        return done is not None

    async def _rebuild(self) -> None:
        """The marks are gone (Redis flushed, or restarted without its data): put them back from the topic."""
        assert self.rebuild is not None
        async with self._rebuilding:
            with redis_transient("idempotency key store"):
                if await self.client.exists(self.intact_key):
                    return  # another handler rebuilt them while this one waited
            log.warning("idempotency marks under %s are gone (Redis flushed or restarted without its data); "
                        "rebuilding them from the output topic before answering", self.prefix)
            n = await self.rebuild()
            await self.arm()
            self.rebuilds += 1
            log.warning("idempotency marks under %s rebuilt: %d results already out", self.prefix, n)

    async def mark(self, key: str) -> None:
        self.unmarked.add(key)  # kept until Redis has the mark (see the module docstring)
        with redis_transient("idempotency key store"):
            await self.client.set(f"{self.prefix}:done:{key}", b"1")
        self.unmarked.discard(key)

    async def add(self, set_name: str, member: str) -> None:
        with redis_transient("idempotency key store"):
            await self.client.sadd(f"{self.prefix}:{set_name}", member)

    async def count(self, set_name: str) -> int:
        with redis_transient("idempotency key store"):
            return int(await self.client.scard(f"{self.prefix}:{set_name}"))

    async def close(self) -> None:
        await self.client.aclose()


def key_store(url: str, prefix: str) -> KeyStore:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryKeyStore() if url == "memory://" else RedisKeyStore(url, prefix)
