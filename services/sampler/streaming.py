"""Streamed completions (``"stream": true``): each token leaves as it is decoded, in vLLM's chunk shapes.

The decoding thread tells :func:`pieces` of every new token (:data:`~services.sampler.decoding.OnToken`);
the event loop gathers what arrived since the last chunk into one piece per prompt. The text of a piece
is what no later token can change (:class:`TextStream`): an unfinished UTF-8 character waits for the
token that ends it, and while stop strings are asked for, the last ``len(longest stop) - 1``
characters wait too (a stop string that is still only partly decoded must not reach the client). Token
ids and logprobs are never held back, so a chunk's text may lag its tokens, as vLLM's does. The
pieces of one generation join to exactly its non-streamed text, ids and logprobs.

:func:`completion_events` and :func:`chat_events` shape them as vLLM's ``text_completion`` and
``chat.completion.chunk`` server-sent events, then an optional usage chunk
(``stream_options.include_usage``) and ``data: [DONE]``; a failure after the first byte is one
``data: {"error": {...}}`` event before ``[DONE]``, as vLLM sends it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from services.sampler.engine import Generation, SamplingParams
from services.sampler.registry import AdapterEntry
from services.sampler.serving import Sampler
from services.sampler.shaping import Plan, chat_logprobs, completion_logprobs

log = logging.getLogger(__name__)


class TextStream:
    """The streamed text of one generation: deltas that only ever extend what was sent."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode = decode
        self.hold = max((len(s) for s in stops if s), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: list[int]) -> str:
        """The text that ``ids`` (the next tokens) make safe to send; may be empty."""
        self.ids.extend(ids)
        text = self.decode(self.ids).rstrip("\ufffd")  # a character split across tokens waits
        safe = text[:max(len(text) - self.hold, 0)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def close(self, final: str) -> str:
        """The rest of ``final`` (the generation's text, cut at its stop string)."""
        if not final.startswith(self.sent):  # a tokenizer whose decoding is not prefix-stable
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final[-40:])
            common = next((i for i, (a, b) in enumerate(zip(self.sent, final)) if a != b),
                          min(len(self.sent), len(final)))
            self.sent = final[:common]
        delta, self.sent = final[len(self.sent):], final
        return delta


@dataclass
class Piece:
    """What one prompt's generation added since its last piece; ``done`` on its last one."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    first: bool = False
    done: Generation | None = None


@dataclass
class _Progress:
    text: TextStream
    seen: int = 0
    started: bool = False
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)


async def pieces(s: Sampler, entry: AdapterEntry | None, plans: list[Plan]) -> AsyncIterator[Piece]:
    """Every prompt of ``plans`` decoded together (continuous batching), as pieces in decoding order;
    the generations are cancelled if the consumer stops early (the client went away)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    def told(i: int) -> Callable[[Generation], None]:
        def on_token(gen: Generation) -> None:  # in the decoding thread: copy what is new, now
            top = gen.top_logprobs[-1] if gen.top_logprobs else None
            loop.call_soon_threadsafe(queue.put_nowait, (i, (gen.token_ids[-1], gen.logprobs[-1], top)))
        return on_token

    async def run(i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            result: Any = await s.generate(entry, ids, params, told(i))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            result = exc
        queue.put_nowait((i, result))

    progress = [_Progress(TextStream(lambda t, p=p: s.eng.decode(t, skip_special_tokens=p.skip_special_tokens),
                                     p.stop)) for _, p in plans]
    tasks = [asyncio.create_task(run(i, ids, p), name=f"sampler:stream:{i}") for i, (ids, p) in enumerate(plans)]
    try:
        remaining = len(plans)
        while remaining:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            finished: dict[int, Generation] = {}
            for i, item in events:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Generation):
                    finished[i] = item
                    continue
                token, lp, top = item
                pr = progress[i]
                pr.ids.append(token)
                pr.lps.append(lp)
                if top is not None:
                    pr.tops.append(top)
            for i, pr in enumerate(progress):
                gen = finished.get(i)
                if gen is not None:  # the last token never reaches on_token: take the rest from the result
                    n = pr.seen + len(pr.ids)
                    pr.ids += gen.token_ids[n:]
                    pr.lps += gen.logprobs[n:]
                    pr.tops += gen.top_logprobs[n:] if gen.top_logprobs else []
                    remaining -= 1
                elif not pr.ids:
                    continue
                text = pr.text.add(pr.ids) if gen is None else pr.text.close(gen.text)
                yield Piece(i, text, pr.ids, pr.lps, pr.tops, first=not pr.started, done=gen)
                pr.seen += len(pr.ids)
                pr.started, pr.ids, pr.lps, pr.tops = True, [], [], []
    finally:
        for task in tasks:
            task.cancel()


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _error_event(exc: BaseException) -> bytes:
    status = getattr(exc, "status", 500)
    return _sse({"error": {"message": str(exc) or type(exc).__name__, "type": getattr(exc, "vllm_type", None)
                           or "InternalServerError", "param": getattr(exc, "param", None), "code": status}})


async def completion_events(s: Sampler, entry: AdapterEntry | None, plans: list[Plan], *, model: str,
                            logprobs: bool, as_ids: bool, token_ids: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """vLLM's streamed ``/v1/completions``: one ``text_completion`` chunk per piece (``token_ids``
    per chunk and ``prompt_token_ids`` on each prompt's first when ``return_token_ids``)."""
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model}
    offsets = [0] * len(plans)
    n_completion = 0
    try:
        async for p in pieces(s, entry, plans):
            choice: dict[str, Any] = {"index": p.index, "text": p.text, "logprobs": None,
                                      "finish_reason": p.done.finish_reason if p.done else None,
                                      "stop_reason": p.done.stop_reason if p.done else None}
            if logprobs:
                part = Generation([], p.token_ids, p.logprobs, p.top_logprobs)
                choice["logprobs"] = completion_logprobs(s.eng, part, as_ids, offset=offsets[p.index])
                if part.token_ids:
                    offsets[p.index] = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1])
            if token_ids:
                choice["token_ids"] = p.token_ids
                if p.first:
                    choice["prompt_token_ids"] = plans[p.index][0]
            n_completion += len(p.token_ids)
            yield _sse({**base, "choices": [choice]})
        if include_usage:
            n_prompt = sum(len(ids) for ids, _ in plans)
            yield _sse({**base, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                                                          "total_tokens": n_prompt + n_completion}})
    except Exception as exc:  # noqa: BLE001 - after the first byte the status is sent: say it in the stream
        log.warning("a streamed completion failed: %s", exc)
        yield _error_event(exc)
    yield b"data: [DONE]\n\n"


async def chat_events(s: Sampler, entry: AdapterEntry | None, plan: Plan, *, model: str, top_logprobs: int | None,
                      as_ids: bool, token_ids: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """vLLM's streamed ``/v1/chat/completions``: a role chunk, then a ``chat.completion.chunk`` per piece."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
    yield _sse({**base, "choices": [first], **({"prompt_token_ids": plan[0]} if token_ids else {})})
    n_completion = 0
    try:
        async for p in pieces(s, entry, [plan]):
            choice: dict[str, Any] = {"index": 0, "delta": {"content": p.text} if p.text else {},
                                      "logprobs": None, "finish_reason": p.done.finish_reason if p.done else None,
                                      "stop_reason": p.done.stop_reason if p.done else None}
            if top_logprobs is not None:
                choice["logprobs"] = chat_logprobs(s.eng, Generation([], p.token_ids, p.logprobs, p.top_logprobs),
                                                   top_logprobs, as_ids)
            if token_ids:
                choice["token_ids"] = p.token_ids
            n_completion += len(p.token_ids)
            yield _sse({**base, "choices": [choice]})
        if include_usage:
            n = len(plan[0])
            yield _sse({**base, "choices": [], "usage": {"prompt_tokens": n, "completion_tokens": n_completion,
                                                          "total_tokens": n + n_completion}})
    except Exception as exc:  # noqa: BLE001
        log.warning("a streamed chat completion failed: %s", exc)
        yield _error_event(exc)
    yield b"data: [DONE]\n\n"
