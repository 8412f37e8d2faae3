"""Topic ``calls``: one model call a harness made through the relay, token-in/token-out.

Producer: relay. The record holds exactly what the fold into segments and datums needs (prompt ids,
sampled ids, the sampler's logprob of each sampled id, the disposition, whether it is housekeeping)
plus what a person needs to read the call back: the adapter version that sampled it, timings, and
the harness's request as received.

Dispositions (relative to the previous non-housekeeping call of the same trace):

- ``new_segment:first``: the episode's first call;
- ``extend``: the prompt ids start with the previous call's prompt ids + sampled ids;
- ``new_segment:history_rewrite``: they do not (the harness rewrote its history, e.g. on a retry);
- ``housekeeping``: a title, summary or compaction call (a header or a configured rule said so),
  served but never part of a segment; it is not "the previous call" of the next one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, model_validator

from schemas.base import Message

Disposition = Literal["new_segment:first", "extend", "new_segment:history_rewrite", "housekeeping"]
DISPOSITIONS: tuple[str, ...] = ("new_segment:first", "extend", "new_segment:history_rewrite", "housekeeping")
#: What a trace id (the ``/tr/<trace_id>`` of a rollout) may look like.
TRACE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class CallTimings(Message):
    """Where the time of one call went (milliseconds)."""

    schema_version: Literal[1] = 1
    render_ms: float = Field(ge=0, description="Rendering the conversation to token ids")
    sample_ms: float = Field(ge=0, description="The sampler's completions round trip")
    total_ms: float = Field(ge=0, description="From the request's arrival to the record being built")


class Call(Message):
    """One harness call: the tokens the policy saw and sampled, and how the call relates to the last."""

    schema_version: Literal[1] = 1
    call_id: str = Field(min_length=1, max_length=160, description="``<trace_id>:<call_index>``")
    trace_id: str = Field(pattern=TRACE_ID_PATTERN, description="The episode (rollout) the call belongs to")
    call_index: int = Field(ge=0, description="0, 1, 2, ... in arrival order within the trace")
    disposition: Disposition
    housekeeping: bool = Field(description="Served, recorded, never in a segment")
    housekeeping_reason: str | None = Field(default=None, max_length=512,
                                            description="``header`` or ``rule:<pattern>`` when housekeeping")
    prompt_ids: tuple[int, ...] = Field(min_length=1, description="The prompt token ids the sampler was sent")
    sampled_ids: tuple[int, ...] = Field(description="The token ids the sampler returned, never re-tokenized")
    sampled_logprobs: tuple[float, ...] = Field(description="The sampler's logprob of each sampled id")
    spliced_from: int | None = Field(
        default=None, ge=0,
        description="The earlier call whose prompt + sampled ids this prompt starts with, because the harness "
                    "sent that call's reply back unchanged (None: rendered afresh)")
    adapter: str | None = Field(default=None, max_length=256,
                                description="The adapter version that sampled (``router@3``); None = the base")
    adapter_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="Content digest of that adapter, as the sampler named it (None: the base, or a sampler "
                    "that names none, e.g. vLLM)")
    sampler_model: str = Field(min_length=1, max_length=512, description="The model name sent to the sampler")
    renderer: str = Field(min_length=1, max_length=64, description="The renderer that made the prompt ids")
    wire: Literal["openai", "anthropic"] = Field(description="Which API the harness spoke")
    stream: bool = Field(default=False, description="Whether the harness asked for a streamed answer")
    text: str = Field(default="", description="The reply text the harness got")
    finish_reason: Literal["stop", "length"] = Field(description="The sampler's finish reason")
    stop_reason: str | int | None = Field(default=None, description="The stop string or token id that ended it")
    request: dict[str, Any] = Field(description="The harness's request body as received")
    started_at: datetime = Field(description="When the request arrived (UTC)")
    timings: CallTimings

    @model_validator(mode="after")
    def _consistent(self) -> Call:
        if len(self.sampled_ids) != len(self.sampled_logprobs):
            raise ValueError(f"{len(self.sampled_ids)} sampled ids but {len(self.sampled_logprobs)} logprobs")
        if self.housekeeping != (self.disposition == "housekeeping"):
            raise ValueError(f"housekeeping={self.housekeeping} contradicts disposition {self.disposition!r}")
        if self.call_id != f"{self.trace_id}:{self.call_index}":
            raise ValueError(f"call_id {self.call_id!r} is not '<trace_id>:<call_index>'")
        if self.call_index == 0 and self.disposition in ("extend", "new_segment:history_rewrite"):
            raise ValueError(f"call 0 of a trace has no previous call, so it cannot be {self.disposition!r}")
        return self
