"""A training datum in the shape of Tinker's ``Datum``: what one relay segment becomes for the trainer.

``model_input`` is a list of encoded-text chunks (their tokens concatenated are the input sequence);
``loss_fn_inputs`` holds ``target_tokens``, ``weights``, ``logprobs`` and ``advantages``, each as long
as the input, aligned by the next-token shift: position ``i`` of the input predicts ``target_tokens[i]``.
``weights`` is 1 where the target is a sampled token and 0 where the harness or template wrote it;
``logprobs`` (the sampler's) and ``advantages`` are 0 wherever ``weights`` is 0.

Producer: :func:`services.common.datums.episode_datums` (from the relay's ``calls``). Consumer: the
trainer (RL). :meth:`Datum.to_tinker` gives the dict a Tinker-compatible API takes.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.base import Message


class EncodedTextChunk(BaseModel):
    """A run of token ids, as Tinker's ``EncodedTextChunk`` (``type`` is always ``encoded_text``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: tuple[int, ...] = Field(min_length=1)
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(BaseModel):
    """The input sequence as chunks, as Tinker's ``ModelInput``; one chunk per call of the segment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunks: tuple[EncodedTextChunk, ...] = Field(min_length=1)

    def to_ints(self) -> list[int]:
        """The input token ids, chunks concatenated."""
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(len(chunk.tokens) for chunk in self.chunks)


class LossFnInputs(BaseModel):
    """The per-position arrays every loss reads, all as long as the model input."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_tokens: tuple[int, ...]
    weights: tuple[float, ...]
    logprobs: tuple[float, ...]
    advantages: tuple[float, ...]

    @model_validator(mode="after")
    def _aligned(self) -> LossFnInputs:
        n = len(self.target_tokens)
        for name in ("weights", "logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, target_tokens has {n}")
        for i, (w, lp, adv) in enumerate(zip(self.weights, self.logprobs, self.advantages)):
            if w not in (0.0, 1.0):
                raise ValueError(f"weights[{i}] is {w}; a weight is 0 (context) or 1 (sampled)")
            if not (math.isfinite(lp) and math.isfinite(adv)):
                raise ValueError(f"position {i}: logprob {lp} / advantage {adv} is not finite")
            if w == 0.0 and (lp != 0.0 or adv != 0.0):
                raise ValueError(f"position {i} has weight 0 but logprob {lp} / advantage {adv}: "
                                 "both must be 0 off the mask")
        return self


class Datum(Message):
    """One segment of one episode's calls, ready to train on (RL: importance sampling and friends)."""

    schema_version: Literal[1] = 1
    trace_id: str | None = Field(default=None, description="The episode (relay trace) it came from")
    segment_index: int = Field(ge=0, description="Which of the episode's segments, in call order")
    call_indices: tuple[int, ...] = Field(min_length=1, description="The calls folded into it, in order")
    model_input: ModelInput
    loss_fn_inputs: LossFnInputs

    @model_validator(mode="after")
    def _lengths(self) -> Datum:
        if self.model_input.length != len(self.loss_fn_inputs.target_tokens):
            raise ValueError(f"model_input has {self.model_input.length} tokens but loss_fn_inputs has "
                             f"{len(self.loss_fn_inputs.target_tokens)} positions")
        return self

    def tokens(self) -> list[int]:
        """The whole segment (input plus the last target): what was sampled and prompted, in order."""
        return self.model_input.to_ints() + list(self.loss_fn_inputs.target_tokens[-1:])

    def to_tinker(self) -> dict[str, Any]:
        """The Datum as Tinker's JSON takes it: chunks, and each loss input as ``TensorData``."""
        lfi = self.loss_fn_inputs
        n = len(lfi.target_tokens)
        arrays = {"target_tokens": (lfi.target_tokens, "int64"), "weights": (lfi.weights, "float32"),
                  "logprobs": (lfi.logprobs, "float32"), "advantages": (lfi.advantages, "float32")}
        return {"model_input": self.model_input.model_dump(mode="json"),
                "loss_fn_inputs": {k: {"data": list(v), "dtype": dt, "shape": [n]}
                                   for k, (v, dt) in arrays.items()}}
