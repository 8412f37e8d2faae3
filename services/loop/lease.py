"""A Redis lease: at most one loop replica runs a given model's cycle at a time.

``SET key token NX PX ttl`` takes it; a holder renews it at a third of the TTL only while the key still
holds its own token (a Lua compare-and-expire) and gives it back with a compare-and-delete, so a replica
whose lease lapsed (paused, partitioned) can neither extend nor delete the lease a second replica took.
A holder that cannot renew stops its cycle (:class:`LeaseLost`): the other replica owns the slot now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from services.common.errors import FanrouteError

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(FanrouteError, RuntimeError):
    """The lease lapsed or another holder took it while a cycle ran."""


def lease_key(namespace: str, model_id: str, kind: str) -> str:
    """The Redis key of the loop's lease for one model id and router kind."""
    return f"fanroute:{namespace}loop:lease:{model_id}:{kind}"


class Lease:
    """One lease key, taken with :meth:`hold` (an async context that renews it in the background)."""

    def __init__(self, url: str, key: str, ttl_s: float) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = secrets.token_hex(16)
        self.lost = asyncio.Event()

    async def try_acquire(self) -> bool:
        """Take the lease if nobody holds it."""
        return bool(await self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def holder(self) -> str | None:
        value = await self.client.get(self.key)
        return value.decode() if value is not None else None

    async def renew(self) -> bool:
        return bool(await self.client.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    async def release(self) -> None:
        await self.client.eval(_RELEASE, 1, self.key, self.token)

    @contextlib.asynccontextmanager
    async def hold(self, wait_s: float) -> AsyncIterator[bool]:
        """Yield True with the lease held (renewed until the block ends), or False if not taken within ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not await self.try_acquire():
            if loop.time() >= deadline:
                yield False
                return
            await asyncio.sleep(min(1.0, self.ttl_ms / 3000))  # polling a key someone else holds, not a sync wait
        self.lost.clear()
        renewer = asyncio.create_task(self._renew_forever(), name=f"lease {self.key}")
        try:
            yield True
        finally:
            renewer.cancel()
            await asyncio.wait({renewer})
            with contextlib.suppress(Exception):  # Redis away: the lease lapses by its TTL
                await self.release()

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                ok = await self.renew()
            except Exception as exc:  # a passing Redis outage: keep trying until the TTL would have lapsed
                log.warning("lease %s: renewal failed (%s); retrying", self.key, exc)
                continue
            if not ok:
                log.error("lease %s: lost (another holder or lapsed)", self.key)
                self.lost.set()
                return

    async def close(self) -> None:
        await self.client.aclose()
