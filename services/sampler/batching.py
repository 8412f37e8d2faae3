"""Micro-batching of scoring requests: concurrent ``prompt_logprobs`` requests share one forward.

A request to score prompts joins a queue and waits for its result. One drain task (on the event
loop) takes the oldest request's adapter, waits ``wait_s`` for more requests — and again while each
wait brought one, or while fewer are queued than that adapter's last forward answered, up to
``max_wait_s`` in all (it stops waiting once ``max_batch`` are queued) — then
hands every queued request for that adapter (at most ``max_batch``) to ``run`` in a worker thread,
where the model runs once for all of them under the engine's lock (so scoring never overlaps a
generation or an adapter load). Requests that arrive during that forward are queued for the next
one. Requests for another adapter wait their turn: one adapter is active per forward.

Why wait again while requests keep coming: a forward has a floor (reading every weight, ≈ 37 ms for
SmolLM2 in bf16 on 2 cores), and the callers a forward answered send their next requests over a few
milliseconds. A fixed 2 ms wait took the first few of them alone and left the rest for the next
forward: two floors per round instead of one. A lone request still waits ``wait_s`` once.

Why also wait for as many as the last forward answered: on a busy machine the answered callers'
next requests come back with gaps longer than ``wait_s`` (their own process, the HTTP server and the
tokenizer share the cores), so "a wait brought one" alone still split a round of 20 closed-loop
decisions into two forwards of ~10 in some of the benchmark's runs (2026-12-07, the same hour: p50
465–521 ms at 20 concurrent, 10.4 requests a forward; with this rule 338–343 ms, 19.2). ``max_wait_s``
bounds what this costs when traffic drops: one batch waits the cap, and the next expects only as
many as it got.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
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

    def __init__(self, run: Runner, *, max_batch: int, wait_s: float, max_wait_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_wait: Callable[[float], None] = lambda seconds: None) -> None:
        max_wait_s = wait_s if max_wait_s is None else max_wait_s
        if max_batch < 1 or wait_s < 0 or max_wait_s < wait_s:
            raise ValueError("max_batch must be >= 1 and 0 <= wait_s <= max_wait_s")
        self.run, self.max_batch, self.wait_s, self.max_wait_s = run, max_batch, wait_s, max_wait_s
        self._clock, self._sleep = clock, sleep  # injectable: tests drive arrivals on a fake clock
        self.on_wait = on_wait  # each batch's gathering time, in seconds (the sampler's histogram)
        self._pending: list[ScoreJob] = []
        self._task: asyncio.Task | None = None
        #: per adapter (by entry id), how many requests its last forward answered: in a closed loop, who comes back
        self._expected: dict[int, int] = {}

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
                started = self._clock()
                await self._gather()
                self.on_wait(self._clock() - started)
                self._pending = [j for j in self._pending if not j.future.done()]  # gone: cancelled
                if not self._pending:
                    break
                entry = self._pending[0].entry
                batch = [j for j in self._pending if j.entry is entry][: self.max_batch]
                taken = {id(j) for j in batch}
                if len(self._expected) >= 64 and id(entry) not in self._expected:  # adapters come and go
                    self._expected.clear()
                self._expected[id(entry)] = len(batch)
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

    async def _gather(self) -> None:
        """Wait ``wait_s``, then again while the last wait brought a request or fewer are queued than the
        adapter's last forward answered, ``max_wait_s`` at most."""
        deadline = self._clock() + self.max_wait_s
        seen = -1
        while (self.wait_s and len(self._pending) < self.max_batch and self._clock() < deadline
               and (seen != len(self._pending) or self._short())):
            seen = len(self._pending)
            await self._sleep(min(self.wait_s, deadline - self._clock()))

    def _short(self) -> bool:
        """Fewer requests queued for the oldest one's adapter than that adapter's last forward answered."""
        entry = self._pending[0].entry if self._pending else None
        queued = sum(1 for j in self._pending if j.entry is entry)
        return queued < self._expected.get(id(entry), 1)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except BaseException as exc:  # noqa: BLE001 - the drain task ends with the cancellation
                log.debug("score batches stopped: %r", exc)
