"""Micro-batching of scoring requests: concurrent ``prompt_logprobs`` requests share one forward.

A request to score prompts joins a queue and waits for its result. One drain task (on the event
loop) takes the oldest request's adapter, waits ``wait_s`` for more requests (bounded: it stops
waiting once ``max_batch`` are queued), then hands every queued request for that adapter (at most
``max_batch``) to ``run`` in a worker thread, where the model runs once for all of them under the
engine's lock (so scoring never overlaps a generation or an adapter load). Requests that arrive
during that forward are queued for the next one. Requests for another adapter wait their turn:
one adapter is active per forward.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ScoreJob:
    """One request's prompts (token ids), its alternatives per position, and where its result goes."""

    entry: Any  # the AdapterEntry (None: the base model); jobs batch together when it is the same object
    prompts: list[list[int]]
    ks: list[int | None]  # None: lean (the row after the prompt only)
    future: asyncio.Future


#: ``run(entry, jobs)`` → one result list per job (one item per prompt), in a worker thread.
Runner = Callable[[Any, list[ScoreJob]], list[list[Any]]]


class ScoreBatcher:
    """Gathers concurrent scoring requests per adapter and runs each batch with one call of ``run``."""

    def __init__(self, run: Runner, *, max_batch: int, wait_s: float) -> None:
        if max_batch < 1 or wait_s < 0:
            raise ValueError("max_batch must be >= 1 and wait_s >= 0")
        self.run, self.max_batch, self.wait_s = run, max_batch, wait_s
        self._pending: list[ScoreJob] = []
        self._task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return len(self._pending)

    async def score(self, entry: Any, prompts: list[list[int]], ks: list[int | None]) -> list[Any]:
        """The results for ``prompts``, scored with whatever else is queued for ``entry``."""
        job = ScoreJob(entry, prompts, ks, asyncio.get_running_loop().create_future())
        self._pending.append(job)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="sampler:score-batches")
        return await job.future

    async def _drain(self) -> None:
        batch: list[ScoreJob] = []
        try:
            while self._pending:
                if self.wait_s and len(self._pending) < self.max_batch:
                    await asyncio.sleep(self.wait_s)
                self._pending = [j for j in self._pending if not j.future.done()]  # gone: cancelled
                if not self._pending:
                    break
                entry = self._pending[0].entry
                batch = [j for j in self._pending if j.entry is entry][: self.max_batch]
                taken = {id(j) for j in batch}
                self._pending = [j for j in self._pending if id(j) not in taken]
                try:
                    results = await asyncio.to_thread(self.run, entry, batch)
                except Exception as exc:  # noqa: BLE001 - the adapter went away, say: each request hears it
                    for j in batch:
                        if not j.future.done():
                            j.future.set_exception(exc)
                    continue
                for j, result in zip(batch, results):
                    if not j.future.done():
                        j.future.set_result(result)
        except BaseException as exc:  # cancelled at shutdown (or a bug): nobody is left waiting forever
            for j in [*batch, *self._pending]:
                if not j.future.done():
                    j.future.set_exception(RuntimeError(f"scoring stopped: {type(exc).__name__}"))
            self._pending.clear()
            raise

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except BaseException as exc:  # noqa: BLE001 - the drain task ends with the cancellation
                log.debug("score batches stopped: %r", exc)
