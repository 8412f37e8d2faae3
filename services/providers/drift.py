"""A provider-degradation scenario for the local market: ``FANROUTE_DRIFT=biomed:0.2@2026-12-05T10:00Z``.

From the given time the named provider keeps its real answer for only ``keep`` of the queries (a
deterministic share, by hash of provider and query) and returns noise for the rest: ``k`` documents of
its own corpus drawn by the query's hash, so the answer still looks like an answer (titles, snippets,
citations) and only a judge that reads it — or the human qrels — can tell. It exists to show that the
fan-out slice catches drift and that the continual loop recovers from it (``fanroute loop demo``).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from services.common.errors import ConfigError
from services.providers.base import Provider, ProviderAnswer, build_answer

_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+):(?P<keep>[0-9]*\.?[0-9]+)(?:@(?P<at>\S+))?$")


@dataclass(frozen=True)
class DriftSpec:
    """From ``at`` (None: from the start), ``provider`` answers for real on ``keep`` of the queries only."""

    provider: str
    keep: float
    at: datetime | None = None

    def active(self, now: datetime) -> bool:
        return self.at is None or now >= self.at


def parse_drift(text: str | None) -> tuple[DriftSpec, ...]:
    """``name:keep[@ISO time]`` items, comma-separated; a ConfigError naming the bad item otherwise."""
    specs: list[DriftSpec] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        m = _SPEC.match(item)
        if m is None:
            raise ConfigError(f"drift: {item!r} is not <provider>:<keep share>[@<ISO time>] "
                              "(e.g. biomed:0.2@2026-12-05T10:00:00Z)")
        keep = float(m["keep"])
        if not 0 <= keep <= 1:
            raise ConfigError(f"drift: {item!r}: the kept share must be within 0..1, got {keep}")
        at = None
        if m["at"]:
            try:
                at = datetime.fromisoformat(m["at"])
            except ValueError:
                raise ConfigError(f"drift: {item!r}: {m['at']!r} is not an ISO 8601 time") from None
            at = at if at.tzinfo else at.replace(tzinfo=UTC)
        if any(s.provider == m["name"] for s in specs):
            raise ConfigError(f"drift: provider {m['name']!r} named twice")
        specs.append(DriftSpec(m["name"], keep, at))
    return tuple(specs)


class DriftingProvider(Provider):
    """``inner`` with a share of its answers replaced by noise from its own corpus once the drift is on."""

    def __init__(self, inner: Provider, spec: DriftSpec) -> None:
        super().__init__(inner.name, cost_usd=inner.cost_usd, timeout_s=inner.timeout_s, k=inner.k)
        self.inner = inner
        self.spec = spec

    async def start(self) -> None:
        await self.inner.start()
        if not getattr(self.inner, "_docs", None):
            raise ConfigError(f"drift: {self.name} has no local corpus to draw noise from (local index providers only)")

    async def close(self) -> None:
        await self.inner.close()

    def degraded(self, query: str, now: datetime | None = None) -> bool:
        """Whether this query's answer is noise now (the same query is always on the same side)."""
        if not self.spec.active(now or datetime.now(UTC)):
            return False
        h = hashlib.sha256(f"fanroute-drift:{self.name}:{query.strip()}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 >= self.spec.keep

    async def search(self, query: str) -> ProviderAnswer:
        answer = await self.inner.search(query)
        if not self.degraded(query):
            return answer
        docs = self.inner._docs  # type: ignore[attr-defined]
        rng = random.Random(f"{self.name}\0{query.strip()}")
        picks = rng.sample(range(len(docs)), min(self.k, len(docs)))
        cites = tuple(self.inner._citation(rank, docs[i], 0.0)  # type: ignore[attr-defined]
                      for rank, i in enumerate(picks, 1))
        return replace(answer, citations=cites, answer=build_answer(cites), raw_meta={**answer.raw_meta, "drift": "noise"})


def with_drift(providers: list[Provider], specs: tuple[DriftSpec, ...]) -> list[Provider]:
    """The providers with the scenario applied; a spec naming no provider here is a ConfigError."""
    names = {p.name for p in providers}
    unknown = [s.provider for s in specs if s.provider not in names]
    if unknown:
        raise ConfigError(f"drift: no provider named {unknown[0]!r} here (providers: {sorted(names)})")
    by_name = {s.provider: s for s in specs}
    return [DriftingProvider(p, by_name[p.name]) if p.name in by_name else p for p in providers]
