"""One-episode credentials: a token minted for one trace id opens ``/tr/<that trace id>/`` and nothing else.

A token is ``frt_`` + 43 url-safe characters (256 random bits). Redis keeps, under the token's sha256
(never the token itself), ``{"trace_id", "expires_at", "revoked_at"}`` for the credential's lifetime
plus a tombstone period, so that a token seen shortly after it expired is refused *as expired*.
Minting is done by whoever launches the rollout: :func:`mint` (a library call writing Redis directly),
``fanroute credentials mint TRACE_ID`` (the same from a shell), or the relay's admin route, which needs the
separate ``FANROUTE_ADMIN_TOKEN``. ``memory://`` keeps it in process (unit tests).
"""

from __future__ import annotations

import abc
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

TOKEN_PREFIX = "frt_"
_TOKEN = re.compile(r"^frt_[A-Za-z0-9_-]{43}$")


def credential_key(namespace: str, token: str) -> str:
    """Redis key of a credential: the token's sha256, so Redis never holds a usable token."""
    return f"fanroute:{namespace}relay:cred:{hashlib.sha256(token.encode()).hexdigest()}"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def well_formed(token: str) -> bool:
    return bool(_TOKEN.match(token))


@dataclass(frozen=True)
class Refusal:
    """Why a credential does not open a path: 401 (no usable credential) or 403 (not this episode)."""

    status: int
    kind: str
    reason: str


class CredentialStore(abc.ABC):
    """Where credentials live: ``put`` a record with a TTL, ``get`` it back, ``delete`` it."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock

    @abc.abstractmethod
    async def put(self, token: str, record: dict, ttl_s: float) -> None: ...

    @abc.abstractmethod
    async def get(self, token: str) -> dict | None: ...

    async def close(self) -> None:
        """Release connections."""

    async def mint(self, trace_id: str, ttl_s: float, tombstone_s: float = 3600.0) -> str:
        """A new token that opens ``trace_id`` for ``ttl_s`` seconds."""
        token = new_token()
        now = self.clock()
        await self.put(token, {"trace_id": trace_id, "minted_at": now, "expires_at": now + ttl_s,
                               "revoked_at": None}, ttl_s + tombstone_s)
        return token

    async def revoke(self, token: str, tombstone_s: float = 3600.0) -> bool:
        """Mark ``token`` revoked (known as revoked until its tombstone ends); False if it is unknown."""
        record = await self.get(token) if well_formed(token) else None
        if record is None:
            return False
        record["revoked_at"] = self.clock()
        await self.put(token, record, max(0.0, float(record["expires_at"]) - self.clock()) + max(tombstone_s, 1.0))
        return True

    async def check(self, token: str | None, trace_id: str) -> Refusal | None:
        """None when ``token`` opens ``trace_id``; else why not."""
        if not token:
            return Refusal(401, "unauthenticated", "no credential: send the episode's token as "
                           "'Authorization: Bearer <token>' or 'x-api-key: <token>'")
        if not well_formed(token):
            return Refusal(401, "malformed_credential", "the credential is not a fanroute episode token "
                           "(frt_ followed by 43 url-safe characters)")
        record = await self.get(token)
        if record is None:
            return Refusal(401, "unknown_credential", "the credential is unknown (never minted, or expired "
                           "long ago)")
        if record.get("revoked_at") is not None:
            return Refusal(401, "revoked_credential", "the credential was revoked")
        if self.clock() >= float(record["expires_at"]):
            return Refusal(401, "expired_credential", "the credential expired "
                           f"{self.clock() - float(record['expires_at']):.0f} s ago")
        if record["trace_id"] != trace_id:
            return Refusal(403, "forbidden", "the credential opens another episode, not this trace id")
        return None


class MemoryCredentialStore(CredentialStore):
    """In-process credentials (lost on exit): unit tests."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.records: dict[str, tuple[dict, float]] = {}

    async def put(self, token: str, record: dict, ttl_s: float) -> None:
        self.records[credential_key("", token)] = (dict(record), self.clock() + ttl_s)

    async def get(self, token: str) -> dict | None:
        found = self.records.get(credential_key("", token))
        return dict(found[0]) if found and found[1] > self.clock() else None


class RedisCredentialStore(CredentialStore):
    """Credentials as Redis strings (JSON) with a TTL, keyed by the token's hash."""

    def __init__(self, url: str, namespace: str, clock: Callable[[], float] = time.time) -> None:
        import redis.asyncio as redis

        super().__init__(clock)
        self.client = redis.Redis.from_url(url)
        self.namespace = namespace

    async def put(self, token: str, record: dict, ttl_s: float) -> None:
        await self.client.set(credential_key(self.namespace, token), json.dumps(record), px=int(ttl_s * 1000))

    async def get(self, token: str) -> dict | None:
        raw = await self.client.get(credential_key(self.namespace, token))
        return json.loads(raw) if raw is not None else None

    async def close(self) -> None:
        await self.client.aclose()


def credential_store(url: str, namespace: str) -> CredentialStore:
    """Redis unless ``url`` is ``memory://``."""
    return MemoryCredentialStore() if url == "memory://" else RedisCredentialStore(url, namespace)


def token_of(authorization: str | None, api_key: str | None) -> str | None:
    """The token as each SDK sends it: ``Authorization: Bearer <t>`` (OpenAI) or ``x-api-key: <t>``
    (Anthropic). A non-Bearer Authorization header counts as no token from it."""
    if api_key:
        return api_key.strip()
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return authorization.strip()  # refused below as malformed, with the reason
    return None
