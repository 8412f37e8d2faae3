"""Continuous batching: every active generation advances by one token per forward.

Requests join a queue; one decoding thread admits them (at most ``max_num_seqs`` active), groups
them by adapter, and runs rounds. In a round each group, under the engine's lock, prefills the
sequences that just joined (each alone: the forward an unbatched generation starts with), then
feeds every active row its next token in one forward over the group's left-padded cache
(:class:`~services.sampler.kvbatch.KVBatch`). Each row samples with its own parameters and seed
and stops on its own EOS, stop ids, stop strings or ``max_tokens``; it leaves the batch when done.
The lock is taken per group step, so scoring batches and adapter loads run between steps.

The engine's :meth:`~services.sampler.engine.Engine.generate` is the unbatched reference; with
``max_num_seqs=1`` this scheduler decodes one request at a time, as the sampler used to.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.sampler.engine import Engine, Generation, SamplingParams, _rng
from services.sampler.kvbatch import KVBatch

log = logging.getLogger(__name__)

#: Called in the decoding thread after each new token of a request (for streaming).
OnToken = Callable[[Generation], None]


@dataclass(eq=False)
class DecodeRequest:
    """One generation in flight: what it asked, what it has, and whom to tell."""

    key: Any  # the adapter entry (None: the base model); rows batch together when it is the same object
    prompt_ids: list[int]
    params: SamplingParams
    finish: Callable[[Generation | BaseException], None]
    on_token: OnToken | None = None
    gen: Generation = field(init=False)
    rng: Any = field(init=False)
    stops: tuple[str, ...] = field(init=False)
    t0: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.gen = Generation(prompt_token_ids=list(self.prompt_ids), token_ids=[], logprobs=[])
        self.rng = _rng(self.params.seed)
        self.stops = tuple(s for s in self.params.stop if s)


@dataclass
class _Group:
    """The active rows of one adapter: their batched cache and, per row, its request."""

    rows: list[DecodeRequest] = field(default_factory=list)
    joining: list[DecodeRequest] = field(default_factory=list)
    batch: KVBatch = field(default_factory=KVBatch)

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)


@dataclass
class DecodeStats:
    """What the decoder has done (read by the sampler's metrics)."""

    steps: int = 0
    rows_stepped: int = 0
    prefills: int = 0

    @property
    def mean_batch(self) -> float:
        return self.rows_stepped / self.steps if self.steps else 0.0


class Decoder:
    """The decoding thread and its queue; ``slot_of(key)`` makes ``key``'s adapter resident (lock held)."""

    def __init__(self, engine: Engine, slot_of: Callable[[Any], str | None], *, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.engine, self.slot_of, self.max_num_seqs = engine, slot_of, max_num_seqs
        self.stats = DecodeStats()
        self._cv = threading.Condition()
        self._pending: list[DecodeRequest] = []
        self._groups: dict[int, tuple[Any, _Group]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> int:
        return sum(len(g) for _, g in self._groups.values())

    @property
    def queued(self) -> int:
        return len(self._pending)

    def submit(self, req: DecodeRequest) -> None:
        """Queue ``req``; its ``finish`` is called (in the decoding thread) with the result or the error."""
        with self._cv:
            if self._stopping:
                raise RuntimeError("the decoder has stopped")
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sampler:decode", daemon=True)
                self._thread.start()
            self._cv.notify()

    async def generate(self, key: Any, prompt_ids: list[int], params: SamplingParams,
                       on_token: OnToken | None = None) -> Generation:
        """Decode ``prompt_ids`` with ``key``'s adapter alongside whatever else is active."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()

        def finish(result: Generation | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, future, result)

        req = DecodeRequest(key, prompt_ids, params, finish, on_token)
        self.submit(req)
        try:
            return await future
        except asyncio.CancelledError:
            req.cancelled = True  # the caller went away: the row leaves at the next step
            raise

    def stop(self) -> None:
        """Fail what is queued or active and end the thread (it finishes the step it is in)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the decoding thread
    def _run(self) -> None:
        try:
            while self._round():
                pass
        except BaseException as exc:  # a bug: nobody may be left waiting for ever
            log.exception("the decoding thread failed")
            self._fail_all(exc)
            raise

    def _round(self) -> bool:
        with self._cv:
            while not self._pending and not self._groups and not self._stopping:
                self._cv.wait()
            if self._stopping:
                self._fail_all(RuntimeError("the sampler is stopping"))
                return False
            room = self.max_num_seqs - self.active
            admitted, self._pending = self._pending[:max(room, 0)], self._pending[max(room, 0):]
        for req in admitted:
            self._groups.setdefault(id(req.key), (req.key, _Group()))[1].joining.append(req)
        for gid, (key, group) in list(self._groups.items()):
            try:
                self._advance(key, group)
            except Exception as exc:  # noqa: BLE001 - e.g. the adapter went away: its requests hear why
                for req in [*group.rows, *group.joining]:
                    req.finish(exc)
                group.rows, group.joining = [], []
                group.batch.keep([])
            if not len(group):
                del self._groups[gid]
        return True

    def _advance(self, key: Any, group: _Group) -> None:
        """Prefill who joined, then one token for every row (one forward), under the engine's lock."""
        import torch

        eng = self.engine
        with eng.lock:
            slot = self.slot_of(key)
            while group.joining:  # each stays in ``joining`` until it is placed, so a failure tells it
                req = group.joining[0]
                if not req.cancelled:
                    cache, logits_V = eng.prefill(req.prompt_ids, slot)
                    self.stats.prefills += 1
                    if not self._sample(req, logits_V, torch.log_softmax(logits_V, dim=-1)):
                        group.batch.add(cache, len(req.prompt_ids))
                        group.rows.append(req)
                group.joining.pop(0)
            self._drop(group, [i for i, r in enumerate(group.rows) if r.cancelled])
            if not group.rows:
                return
            logits_BV = eng.decode_step(group.batch, [r.gen.token_ids[-1] for r in group.rows], slot)
        self.stats.steps += 1
        self.stats.rows_stepped += len(group.rows)
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        done = [i for i, req in enumerate(group.rows) if self._sample(req, logits_BV[i], logprobs_BV[i])]
        self._drop(group, done)

    def _sample(self, req: DecodeRequest, logits_V: Any, logprobs_V: Any) -> bool:
        """Pick ``req``'s next token; True (and ``req`` told) when that ends it."""
        eng, gen, params = self.engine, req.gen, req.params
        token = eng._step(gen, logits_V, logprobs_V, params, req.rng)
        finished = eng._finished(gen, token, params, req.stops) or len(gen.token_ids) >= params.max_tokens
        if finished:
            req.finish(eng._done(gen, params, req.t0))
        elif req.on_token is not None:
            req.on_token(gen)
        return finished

    @staticmethod
    def _drop(group: _Group, rows: list[int]) -> None:
        if rows:
            gone = set(rows)
            group.batch.keep([i for i in range(len(group.rows)) if i not in gone])
            group.rows = [r for i, r in enumerate(group.rows) if i not in gone]

    def _fail_all(self, exc: BaseException) -> None:
        for req in [*self._pending, *(r for _, g in self._groups.values() for r in [*g.rows, *g.joining])]:
            req.finish(exc)
        self._pending.clear()
        self._groups.clear()


def _settle(future: asyncio.Future, result: Generation | BaseException) -> None:
    if future.done():  # cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
