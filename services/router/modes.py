"""How a router is asked (one home for the gateway's, ``fanroute eval``'s and the benchmark's default)."""

from __future__ import annotations

from typing import Literal

RouterMode = Literal["score", "first-token", "generate"]
MODES: tuple[RouterMode, ...] = ("score", "first-token", "generate")
#: How the gateway and ``fanroute eval`` ask the router unless told otherwise.
DEFAULT_MODE: RouterMode = "score"
