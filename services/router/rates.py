"""The top-tier table a router decides with: for each label (the judge's cost-aware first choice), how
often each provider was in the judge's top tier on the training episodes with that label.

Why: a router is trained to name the cheapest provider of the judge's top tier, so its probabilities
say "this provider is the cheapest of the best", not "this provider's answer is among the best". When
a vertical and ``web-lexical`` tie, the label is the vertical; a router unsure between two verticals
then picks one of them although the generalist is in the top tier on both kinds of query. The
``top-tier`` decision asks instead: for each provider, the probability that it is in the judge's top
tier, ``Σ_l P(l | query) · rate[l][provider]`` — the router's belief over labels mapped through what
the training episodes say each label implies. Nothing here is tuned: the table is counted from the
same training episodes the router learned from, and published with it (a LoRA adapter's
:data:`~services.common.adapter_files.RATES_FILE`; inside a linear router's artifact).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from schemas.episode import Episode
from services.common.adapter_files import RATES_FILE
from services.common.errors import FanrouteError
from services.common.ndcg import parse_ordering

log = logging.getLogger(__name__)

Rates = Mapping[str, Mapping[str, float]]
FORMAT = "fanroute-top-tier-rates"
VERSION = 1
RULE = ("label = the first name of the judge's cost-aware ordering; rate[label][provider] = share of the "
        "training episodes with that label whose judge top tier holds the provider")


class RatesError(FanrouteError, ValueError):
    """A top-tier table that cannot be used (malformed file, a rate outside [0, 1])."""


def judge_tiers(ep: Episode) -> list[list[str]] | None:
    """The judge's ordering in the episode's assistant turn, as tiers; None when it does not parse or is empty."""
    answer = next((m.content for m in reversed(ep.messages) if m.role == "assistant"), "")
    try:
        tiers = parse_ordering(answer)
    except ValueError:
        return None
    return tiers if tiers and tiers[0] else None


def top_tier_rates(episodes: Sequence[Episode]) -> dict[str, dict[str, float]]:
    """label → provider → share of that label's episodes with the provider in the top tier (episodes whose
    assistant turn does not parse are left out; a label is always in its own top tier: rate 1)."""
    counts: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for ep in episodes:
        tiers = judge_tiers(ep)
        if tiers is None:
            continue
        label = tiers[0][0]
        totals[label] = totals.get(label, 0) + 1
        row = counts.setdefault(label, {})
        for name in tiers[0]:
            row[name] = row.get(name, 0) + 1
    return {label: {n: round(c / totals[label], 6) for n, c in sorted(row.items())}
            for label, row in sorted(counts.items())}


def expected_top_tier(probs: Mapping[str, float], rates: Rates) -> dict[str, float]:
    """Provider → P(in the judge's top tier) = Σ over labels of P(label) · rate[label][provider]. A label
    the table never saw stands for itself only (rate 1 for itself, 0 for the others)."""
    out = {}
    for name in probs:
        out[name] = math.fsum(p * (rates[label].get(name, 0.0) if label in rates else float(label == name))
                              for label, p in probs.items())
    return out


def to_json(rates: Rates, episodes: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "rule": RULE, "episodes": episodes,
            "rates": {lab: dict(row) for lab, row in rates.items()}}


def from_json(data: Any) -> dict[str, dict[str, float]]:
    """The table in :func:`to_json`'s data; :class:`RatesError` naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise RatesError(f"not a version-{VERSION} {FORMAT} document")
    return table_from(data.get("rates"))


def table_from(table: Any) -> dict[str, dict[str, float]]:
    """A label → provider → rate table checked (as a document's ``rates`` or a linear artifact's
    ``top_tier_rates``); :class:`RatesError` naming what is wrong."""
    if not isinstance(table, dict):
        raise RatesError("rates: not an object of label → provider → rate")
    out: dict[str, dict[str, float]] = {}
    for label, row in table.items():
        if not isinstance(row, dict):
            raise RatesError(f"rates.{label}: not an object of provider → rate")
        for name, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise RatesError(f"rates.{label}.{name}: {value!r} is not a rate in [0, 1]")
        out[str(label)] = {str(n): float(v) for n, v in row.items()}
    return out


class PublishedRates:
    """The top-tier tables of published LoRA versions, pulled once per version from the publisher.

    A version published without the file (or a publisher that cannot be reached) decides by the first
    choice; the miss is logged once and asked again after ``retry_s``.
    """

    def __init__(self, publisher_url: str, *, timeout_s: float = 10.0, retry_s: float = 60.0) -> None:
        self.publisher_url = publisher_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._known: dict[str, dict[str, dict[str, float]] | None] = {}
        self._missed: dict[str, float] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}

    async def get(self, model: str, *, wait_s: float | None = None) -> dict[str, dict[str, float]] | None:
        """The table of served version ``model`` (``<model_id>@<version>``), or None (none published, the
        publisher unreachable, or not pulled within ``wait_s``: the pull goes on for the next call)."""
        if model in self._known:
            return self._known[model]
        loop = asyncio.get_running_loop()
        if loop.time() - self._missed.get(model, -math.inf) < self.retry_s:
            return None
        task = self._loading.get(model)
        if task is None:
            task = self._loading[model] = asyncio.create_task(self._load(model))
            task.add_done_callback(lambda _t: self._loading.pop(model, None))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=wait_s)
        except TimeoutError:
            return None
        return self._known.get(model)

    async def _load(self, model: str) -> None:
        try:
            found = await asyncio.to_thread(self._pull, model)
        except (FanrouteError, OSError, ValueError) as exc:
            self._missed[model] = asyncio.get_running_loop().time()
            log.warning("no top-tier table for %s (it decides by the first choice): %s", model, exc)
            return
        self._known[model] = found
        if found is None:
            log.info("%s was published without %s: it decides by the first choice", model, RATES_FILE)

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()

    def _pull(self, model: str) -> dict[str, dict[str, float]] | None:
        from schemas.adapter import parse_versioned
        from services.common.publisher_client import PublisherClient

        parsed = parse_versioned(model)
        if parsed is None:
            raise RatesError(f"{model!r} is not a published version (<model_id>@<version>)")
        with PublisherClient(self.publisher_url, timeout_s=self.timeout_s) as client:
            manifest = client.manifest(*parsed)
            if RATES_FILE not in manifest.get("files_sha256", {}):
                return None
            return from_json(json.loads(client.fetch_file(manifest, RATES_FILE)))


__all__ = ["PublishedRates", "Rates", "RatesError", "expected_top_tier", "from_json", "judge_tiers", "table_from",
           "to_json", "top_tier_rates"]
