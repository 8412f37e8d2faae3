"""The one split of the development queries into a tuning half and a validation half.

Anything tuned on dev queries (the verticals' BM25 settings, the local judge's cut points) is tuned
on the ``tune`` half only; figures meant to be honest are reported on the ``validation`` half.
Membership is a salted hash of the query id (``<collection>/<query_id>``), so it never changes.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Half = Literal["tune", "validation"]
SALT = "fanroute-dev-half"


def dev_half(query_id: str) -> Half:
    """``"tune"`` or ``"validation"`` for a dev query id, half each, fixed by hash."""
    bucket = int.from_bytes(hashlib.sha256(f"{SALT}:{query_id}".encode()).digest()[:8], "big")
    return "tune" if bucket < 2**63 else "validation"


def normalise_query(text: str) -> str:
    """Lower-cased, whitespace-collapsed: how a query is matched across splits (held out = no training
    episode or task has the same normalised text)."""
    return " ".join(text.lower().split())
