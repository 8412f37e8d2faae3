"""The provider interface: start once, answer a query with top-k citations, close."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from schemas.trace import Citation


@dataclass(frozen=True)
class ProviderAnswer:
    """What a provider returns: ranked citations, an answer text and what the call cost."""

    citations: tuple[Citation, ...]
    answer: str
    cost_usd: float
    raw_meta: dict[str, object] = field(default_factory=dict)


class Provider(abc.ABC):
    """One search provider. Clients and indexes load in :meth:`start`, never per query.

    ``search`` raises a :class:`services.common.errors.ProviderError` subclass on failure; the
    gateway enforces ``timeout_s`` around it and records any error on the candidate.
    """

    def __init__(self, name: str, *, cost_usd: float, timeout_s: float, k: int) -> None:
        self.name = name
        self.cost_usd = cost_usd
        self.timeout_s = timeout_s
        self.k = k

    async def start(self) -> None:
        """Load indexes or open HTTP clients (idempotent)."""

    async def close(self) -> None:
        """Release clients."""

    @abc.abstractmethod
    async def search(self, query: str) -> ProviderAnswer:
        """Answer ``query`` with up to ``self.k`` citations."""


def build_answer(citations: tuple[Citation, ...] | list[Citation], *, max_sources: int = 3,
                 max_chars: int = 280) -> str:
    """A short extractive answer: the top sources' titles and opening text, numbered like citations."""
    parts = []
    for c in list(citations)[:max_sources]:
        body = " ".join(c.snippet.split())
        if len(body) > max_chars:
            body = body[:max_chars].rsplit(" ", 1)[0] + " …"
        head = c.title.strip() or c.url
        parts.append(f"[{c.rank}] {head}: {body}" if body else f"[{c.rank}] {head}")
    return "\n".join(parts)
