"""The linear router served in-process: the gateway's router client when ``routing.kind = linear``.

It answers :meth:`route` like :class:`services.router.client.RouterClient` — the same
:class:`RouterAnswer` with every provider's score, so the gateway decides by P(best) − λ · cost the same
way — but computes it in this process from the version's artifact, pulled once from the publisher
(every file's sha256 verified) and kept in memory. Deciding takes milliseconds, no model server.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from schemas.adapter import parse_versioned
from services.common.adapter_files import LINEAR_ARTIFACT, AdapterFilesError, artifact_kind, content_digest
from services.router.client import RouterAnswer, RouterError, RouterTimeout
from services.router.linear import LinearRouter, LinearRouterError, from_artifact
from services.router.parse import ParsedOrdering
from services.router.rates import RatesError
from services.router.scoring import decide

#: Versions kept loaded (a promotion and the one before it, with room to spare).
RESIDENT = 4


class LinearRouterClient:
    """Route with published linear-router versions, loaded from the publisher on first use."""

    def __init__(self, publisher_url: str, *, timeout_s: float = 2.0, fetch_timeout_s: float = 60.0) -> None:
        if timeout_s <= 0 or fetch_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        self.publisher_url = publisher_url.rstrip("/")
        self.timeout_s = timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self._loaded: OrderedDict[str, tuple[LinearRouter, str]] = OrderedDict()  # with its content digest
        self._loading: dict[str, asyncio.Task[tuple[LinearRouter, str]]] = {}

    async def start(self) -> None:
        """Nothing to open: each pull is one publisher request."""

    async def close(self) -> None:
        for task in self._loading.values():
            task.cancel()
        self._loading.clear()

    async def prepare(self, model: str) -> None:
        """Pull and load ``model`` now (on a promotion), so the first routed request does not wait for it."""
        await self._router(model, self.fetch_timeout_s)

    async def route(self, model: str, providers: Sequence[str], query: str, *,
                    timeout_s: float | None = None) -> RouterAnswer:
        """The linear router's scores and ordering for ``query``; RouterError (a subclass) when there is none."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        router, digest = await self._router(model, budget)
        scores = router.scores(query, providers)
        parsed = ParsedOrdering(tiers=tuple((n,) for n in decide(scores, {}, 0.0)), unknown=(), missing=())
        return RouterAnswer(parsed, "", round((time.perf_counter() - t0) * 1000.0, 3),
                            scores={n: round(s, 6) for n, s in scores.items()}, adapter_sha256=digest,
                            rates=router.rates)

    async def _router(self, model: str, budget: float) -> tuple[LinearRouter, str]:
        if model in self._loaded:
            self._loaded.move_to_end(model)
            return self._loaded[model]
        task = self._loading.get(model)
        if task is None or (task.done() and task.exception() is not None):
            task = self._loading[model] = asyncio.create_task(asyncio.to_thread(self._pull, model))
        try:
            router = await asyncio.wait_for(asyncio.shield(task), timeout=budget)
        except TimeoutError:
            raise RouterTimeout(f"linear router {model} is still being pulled from {self.publisher_url}") from None
        finally:
            if task.done():
                self._loading.pop(model, None)
        self._loaded[model] = router
        while len(self._loaded) > RESIDENT:
            self._loaded.popitem(last=False)
        return router

    def _pull(self, model: str) -> tuple[LinearRouter, str]:
        """Download, verify and load one version (in a thread), with its content digest (the manifest's, which
        routed traces record as ``route.router_sha256``); every failure is a RouterError."""
        from services.common.publisher_client import PublisherClient, PublisherClientError

        parsed = parse_versioned(model)
        if parsed is None:
            raise RouterError(f"{model!r} is not a published version (<model_id>@<version>)")
        model_id, version = parsed
        try:
            with PublisherClient(self.publisher_url, timeout_s=self.fetch_timeout_s) as client, \
                    tempfile.TemporaryDirectory(prefix="fanroute-linear-") as tmp:
                manifest = client.manifest(model_id, version)
                if artifact_kind(manifest.get("files_sha256", {})) != "linear":
                    raise RouterError(f"{model} is a LoRA adapter, not a linear router: serve it with "
                                      "routing.kind=lm (the sampler)")
                directory = client.fetch_version(model_id, version, Path(tmp) / "v")
                data = json.loads((directory / LINEAR_ARTIFACT).read_text())
        except PublisherClientError as exc:
            raise RouterError(f"linear router {model}: the publisher at {self.publisher_url}: {exc}",
                              status=exc.status) from exc
        except (AdapterFilesError, OSError, ValueError) as exc:
            raise RouterError(f"linear router {model}: its artifact could not be read: {exc}") from exc
        try:
            return from_artifact(data), content_digest(manifest["files_sha256"])
        except (LinearRouterError, RatesError) as exc:
            raise RouterError(f"linear router {model}: {exc}") from exc
