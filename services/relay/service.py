"""The running relay: render, sample, keep. One :meth:`Relay.call` per harness call.

Per call: decide whether it is housekeeping (the header, or a configured rule), render the
conversation to token ids with the policy's renderer (splicing in an earlier call's exact ids where the
harness sent its reply back unchanged), sample through the sampler's ``/v1/completions`` with those
ids, decide the disposition against the previous non-housekeeping call, publish the ``Call`` record on
``calls`` (acks=all, before the harness gets its answer) and keep it in Redis for the next call and the
episode's fold.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from schemas import topic
from schemas.call import Call, CallTimings
from services.common.bus import Bus
from services.common.stamps import StampStore, stamp_store
from services.relay.conversation import ChatRequest, Reply
from services.relay.credentials import CredentialStore, credential_store
from services.relay.render import TOOL_CALL_OPEN, Renderer, build_prompt, parse_tool_calls
from services.relay.sampling import Sampled, SamplerClient
from services.relay.settings import RelaySettings
from services.relay.state import CallState, call_state, entry_of, prior_of

log = logging.getLogger(__name__)
TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Outcome:
    """A served call: its record, the reply, and what streaming needs (text deltas, token texts)."""

    call: Call
    reply: Reply
    deltas: list[str]
    token_texts: list[str]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from services.models.load import require_local

    return AutoTokenizer.from_pretrained(require_local(path, "FANROUTE_TOKENIZER"))


def disposition(prompt_ids: list[int], previous: Call | None) -> str:
    """``extend`` when the prompt starts with the previous call's prompt + sampled ids, else a new segment."""
    if previous is None:
        return "new_segment:first"
    before = [*previous.prompt_ids, *previous.sampled_ids]
    return "extend" if len(prompt_ids) >= len(before) and prompt_ids[:len(before)] == before \
        else "new_segment:history_rewrite"


class Relay:
    """Renderer, sampler client, Kafka, and the Redis stores of credentials, calls and adapter stamps."""

    def __init__(self, settings: RelaySettings, *, renderer: Renderer | None = None,
                 sampler: SamplerClient | None = None, credentials: CredentialStore | None = None,
                 state: CallState | None = None, stamps: StampStore | None = None, bus: Bus | None = None) -> None:
        ns = settings.kafka.topic_namespace
        self.settings = settings
        self._renderer = renderer
        self.sampler = sampler or SamplerClient(settings.sampler_url, settings.sampler_timeout_s)
        self.credentials = credentials or credential_store(settings.redis.url, ns)
        self.state = state or call_state(settings.redis.url, ns, settings.state_ttl_s)
        self.stamps = stamps or stamp_store(settings.redis.url, ns)
        self.bus = bus or Bus(settings.kafka, client_id=f"{settings.kafka.client_id}-relay")
        self.rules = [re.compile(r, re.IGNORECASE) for r in settings.housekeeping_rules]
        self._base_model: str | None = settings.base_model_name

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer(load_tokenizer(self.settings.tokenizer), self.settings.renderer)
        return self._renderer

    async def start(self) -> None:
        _ = self.renderer  # load the tokenizer before serving
        await self.bus.start((topic("calls"),))

    async def stop(self) -> None:
        await self.bus.stop()
        for closing in (self.sampler, self.credentials, self.state, self.stamps):
            await closing.close()

    # ------------------------------------------------------------------------- policy
    async def base_model(self) -> str:
        if self._base_model is None:
            ids = await self.sampler.model_ids()
            if not ids:
                from services.relay.sampling import SamplerUnusable

                raise SamplerUnusable("the sampler lists no model")
            self._base_model = ids[0]
        return self._base_model

    async def policy(self) -> tuple[str, str | None]:
        """(model name for the sampler, adapter version or None): the adapter's newest stamp, else the base."""
        model_id = self.settings.adapter_model_id
        if model_id:
            version = await self.stamps.get(model_id)
            if version > 0:
                name = f"{model_id}@{version}"
                return name, name
        return await self.base_model(), None

    def housekeeping(self, req: ChatRequest, headers: Any) -> str | None:
        """Why this call is housekeeping (``header`` / ``rule:<pattern>``), or None."""
        if str(headers.get(self.settings.housekeeping_header, "")).strip().lower() in TRUE:
            return "header"
        system, user = req.texts()
        for rule in self.rules:
            if rule.search(system) or rule.search(user):
                return f"rule:{rule.pattern}"
        return None

    async def end(self, trace_id: str, calls: list[Call], advantage: float = 0.0) -> dict[str, Any]:
        """The episode's calls folded into segments and each segment into a Tinker-shaped datum
        (:func:`services.common.datums.episode_datums`), with ``advantage`` on every sampled token."""
        from services.common.datums import episode_datums, fold_segments

        counts: dict[str, int] = {}
        for c in calls:
            counts[c.disposition] = counts.get(c.disposition, 0) + 1
        datums = episode_datums(calls, advantage=advantage, trace_id=trace_id)
        return {"trace_id": trace_id, "calls": len(calls), "dispositions": counts,
                "segments": len(fold_segments(calls)), "datums": [d.model_dump(mode="json") for d in datums],
                "call_records": [c.model_dump(mode="json") for c in calls]}  # the rollout runner keeps them

    # --------------------------------------------------------------------------- calls
    async def _prepare(self, trace_id: str, req: ChatRequest, headers: Any) -> _Prepared:
        """What a call needs before sampling: housekeeping, the rendered prompt, the policy."""
        t0, started = time.perf_counter(), datetime.now(UTC)
        reason = self.housekeeping(req, headers)
        entries = await self.state.entries(trace_id)
        kept = [e for e in entries if not e["call"]["housekeeping"]]
        prompt_ids, spliced = build_prompt(self.renderer, req.messages, req.tools, [prior_of(e) for e in kept])
        t1 = time.perf_counter()
        model, adapter = await self.policy()
        return _Prepared(trace_id, t0, t1, started, reason, kept, prompt_ids, spliced, model, adapter)

    async def call(self, trace_id: str, req: ChatRequest, headers: Any) -> Outcome:
        prep = await self._prepare(trace_id, req, headers)
        sampled = await self.sampler.complete(prep.model, prep.prompt_ids, req.sampling)
        t2 = time.perf_counter()
        out = await self._keep(prep, req, sampled, await self.state.next_index(prep.trace_id), t2)
        return Outcome(out.call, out.reply, text_deltas(self.renderer, sampled.token_ids, out.reply.text)
                       if req.stream else [], out.token_texts)

    async def stream_call(self, trace_id: str, req: ChatRequest, headers: Any) -> AsyncIterator[Started | str | Outcome]:
        """A streamed call, passed on as the sampler decodes it: :class:`Started` once the sampler has
        answered (refusals raise before it), then text deltas, then the :class:`Outcome` once its
        ``Call`` record is published. A streamed call takes its index when it starts (its events carry
        the call's id); the harness has its whole answer only after the record is on ``calls``."""
        prep = await self._prepare(trace_id, req, headers)
        index = await self.state.next_index(trace_id)
        held = HeldText(tools=bool(req.tools and self.renderer.hermes))
        pieces = self.sampler.stream(prep.model, prep.prompt_ids, req.sampling)
        try:
            item = await anext(pieces)
            yield Started(f"{trace_id}:{index}", len(prep.prompt_ids))
            while isinstance(item, str):
                if delta := held.add(item):
                    yield delta
                item = await anext(pieces)
        finally:
            await pieces.aclose()
        out = await self._keep(prep, req, item, index, time.perf_counter())
        if rest := held.close(out.reply.text):
            yield rest
        yield out

    async def _keep(self, prep: _Prepared, req: ChatRequest, sampled: Sampled, index: int, t2: float) -> Outcome:
        """The reply (tool calls parsed), and the ``Call`` record published and kept for the next call."""
        trace_id = prep.trace_id
        text, calls = sampled.text, []
        if req.tools and self.renderer.hermes:
            text, calls = parse_tool_calls(sampled.text, f"call_{trace_id[-8:]}_{index}_")
            if req.wire == "anthropic":
                calls = [{**c, "id": "toolu_" + c["id"][5:]} for c in calls]
        reply = Reply(text=text, tool_calls=calls, finish_reason="stop" if sampled.finish_reason == "stop" else "length",
                      stop_reason=sampled.stop_reason, sampled_ids=sampled.token_ids, logprobs=sampled.logprobs,
                      top_logprobs=sampled.top_logprobs, prompt_tokens=len(prep.prompt_ids))
        previous = max((Call.model_validate(e["call"]) for e in prep.kept), key=lambda c: c.call_index, default=None)
        reason = prep.reason
        call = Call(call_id=f"{trace_id}:{index}", trace_id=trace_id, call_index=index,
                    disposition="housekeeping" if reason else disposition(prep.prompt_ids, previous),  # type: ignore[arg-type]
                    housekeeping=reason is not None, housekeeping_reason=reason, prompt_ids=tuple(prep.prompt_ids),
                    sampled_ids=tuple(sampled.token_ids), sampled_logprobs=tuple(sampled.logprobs),
                    spliced_from=prep.spliced, adapter=prep.adapter, adapter_sha256=sampled.adapter_sha256,
                    sampler_model=prep.model, renderer=self.renderer.name,
                    wire=req.wire, stream=req.stream, text=sampled.text, finish_reason=reply.finish_reason,
                    stop_reason=sampled.stop_reason, request=req.raw, started_at=prep.started,
                    timings=CallTimings(render_ms=(prep.t1 - prep.t0) * 1e3, sample_ms=(t2 - prep.t1) * 1e3,
                                        total_ms=(time.perf_counter() - prep.t0) * 1e3))
        await self.bus.publish(topic("calls"), call)
        await self.state.append(trace_id, entry_of(call, req.messages, req.tools, reply.message()))
        texts = [self.renderer.token_text(t) for t in sampled.token_ids] if req.sampling.top_logprobs is not None else []
        return Outcome(call, reply, [], texts)


@dataclass(frozen=True)
class _Prepared:
    trace_id: str
    t0: float
    t1: float
    started: datetime
    reason: str | None
    kept: list[dict[str, Any]]
    prompt_ids: list[int]
    spliced: Any
    model: str
    adapter: str | None


@dataclass(frozen=True)
class Started:
    """A streamed call has begun: its id (the events' id) and its prompt's length (Anthropic's
    ``message_start`` reports it)."""

    call_id: str
    prompt_tokens: int


class HeldText:
    """The text a streamed call may pass on: all of it, or, when tool calls may follow (Hermes), nothing
    from a ``<tool_call>`` on (or what could begin one) and no trailing whitespace, since the reply's
    text is the text before its first call, stripped."""

    def __init__(self, *, tools: bool) -> None:
        self.tools, self.raw, self.sent = tools, "", ""

    def add(self, piece: str) -> str:
        self.raw += piece
        safe = self.raw
        if self.tools:
            at = safe.find(TOOL_CALL_OPEN)
            if at < 0:
                at = next((i for i in range(max(len(safe) - len(TOOL_CALL_OPEN) + 1, 0), len(safe))
                           if TOOL_CALL_OPEN.startswith(safe[i:])), len(safe))
            safe = safe[:at].rstrip()
        if len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def close(self, text: str) -> str:
        """The rest of the reply's ``text`` (what was sent is always a prefix of it)."""
        if not text.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the reply %r", self.sent[-40:], text[-40:])
            return ""
        return text[len(self.sent):]


def text_deltas(renderer: Renderer, ids: list[int], text: str) -> list[str]:
    """``text`` cut at token boundaries (a token that ends inside a UTF-8 character waits for the next):
    the streamed deltas, which join to exactly ``text``."""
    out, emitted = [], 0
    for i in range(1, len(ids) + 1):
        partial = renderer.decode(ids[:i])
        if partial.endswith("\ufffd"):
            continue
        n = len(partial) if text.startswith(partial) else _common(partial, text)
        if n > emitted:
            out.append(text[emitted:n])
            emitted = n
        if emitted >= len(text):
            break
    if emitted < len(text):
        out.append(text[emitted:])
    return out


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
