"""Which requests keep fanning out, and the order providers are tried in when routing."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def in_fanout_slice(key: str, fraction: float) -> bool:
    """True for the deterministic ``fraction`` of keys (request or query ids) that keep fanning out.

    A hash, not a random draw: a retried request lands on the same side, and the slice is the same
    set of queries on every gateway replica.
    """
    return in_hashed_share(key, fraction, salt="fanroute-slice")


#: The salt of the held-out split of development queries (the demo's and the loop's evaluations).
HELD_OUT_SALT = "fanroute-heldout"


def held_out(query_key: str, fraction: float) -> bool:
    """Deterministic held-out membership by hash of the query id (the same split on every run and replica)."""
    return in_hashed_share(query_key, fraction, salt=HELD_OUT_SALT)


def in_hashed_share(key: str, fraction: float, *, salt: str) -> bool:
    """True for a deterministic ``fraction`` of keys: sha256 of ``salt:key`` as a point in [0, 1).

    Different salts give independent splits (the fan-out slice, the demo's held-out queries).
    """
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    bucket = int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode()).digest()[:8], "big")
    return bucket < fraction * 2**64


def call_order(ordering: Sequence[str], providers: Sequence[str], fallback: str | None = None) -> list[str]:
    """Providers in the order to try them: the router's ordering, then ``fallback``, then the rest as configured."""
    known = set(providers)
    head = [p for p in ordering if p in known]
    if fallback in known:
        head.append(fallback)
    return list(dict.fromkeys([*head, *providers]))
