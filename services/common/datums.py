"""Fold one episode's relay calls into segments and each segment into a Tinker-shaped training datum.

Why: RL must train on exactly the tokens the policy sampled. Re-rendering the conversation from text
can change tokens (a chat template re-tokenizes the assistant's text), so the fold never looks at
text: it works only on the ids the relay kept per call.

The contract (what the relay's ``calls`` records must give, per call; :class:`CallTokens` holds it and
:meth:`CallTokens.of` reads it from any object or mapping with these names):

- ``call_index``: the call's order in the episode (the fold sorts by it; duplicates are an error);
- ``prompt_ids``: the whole prompt the sampler saw, as token ids;
- ``sampled_ids`` / ``sampled_logprobs``: what the sampler returned, one logprob per sampled id;
- ``disposition``: ``extend``, ``new_segment:<why>`` (e.g. ``new_segment:history_rewrite``),
  ``housekeeping`` or empty (then the tokens decide); ``housekeeping`` (bool, default False) too.

The rules: housekeeping calls never enter a segment. A call whose ``prompt_ids`` start with the
current segment's tokens (every prompt and sampled token so far) continues it: the prompt tokens it
adds (what the harness and template wrote) get mask 0, its sampled tokens mask 1 with the sampler's
logprobs. Otherwise (or when the disposition says ``new_segment:...``) a new segment starts with the
call's whole prompt at mask 0; a call marked ``extend`` whose ids do not extend is refused, since the
record contradicts itself. Each segment becomes one :class:`~schemas.datum.Datum` by the next-token
shift (input = tokens[:-1], targets = tokens[1:], weights/logprobs/advantages aligned to the targets,
zero off the mask); a segment with no sampled token trains nothing and yields no datum. The
advantage is one number for the episode (reward minus its group's mean is the caller's job) or one
per sampled token of the episode, in call order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.datum import Datum, EncodedTextChunk, LossFnInputs, ModelInput
from schemas.errors import FanrouteError

EXTEND = "extend"
HOUSEKEEPING = "housekeeping"
NEW_SEGMENT = "new_segment"


class DatumError(FanrouteError, ValueError):
    """An episode's calls cannot be folded into datums (bad lengths, order or a contradicting record)."""


class CallLike(Protocol):
    """What the fold reads from a call record (``housekeeping`` is optional, see :meth:`CallTokens.of`)."""

    call_index: int
    prompt_ids: Sequence[int]
    sampled_ids: Sequence[int]
    sampled_logprobs: Sequence[float]
    disposition: str


@dataclass(frozen=True)
class CallTokens:
    """One relay call's tokens: the fold's input, independent of how the relay stores its record."""

    call_index: int
    prompt_ids: tuple[int, ...]
    sampled_ids: tuple[int, ...]
    sampled_logprobs: tuple[float, ...]
    disposition: str = ""
    housekeeping: bool = False

    @classmethod
    def of(cls, call: CallLike | Mapping[str, Any]) -> CallTokens:
        """Read a call from any object or mapping that has the contract's names."""
        if isinstance(call, CallTokens):
            return call

        def get(name: str, default: Any = None) -> Any:
            value = call.get(name, default) if isinstance(call, Mapping) else getattr(call, name, default)
            if value is None:
                if default is None:
                    raise DatumError(f"call record {call!r:.80} has no {name!r}")
                return default
            return value

        disposition, housekeeping = get("disposition", ""), bool(get("housekeeping", False))
        empty = () if housekeeping or disposition == HOUSEKEEPING else None  # never read: may be absent
        return cls(call_index=get("call_index"), prompt_ids=tuple(get("prompt_ids", empty)),
                   sampled_ids=tuple(get("sampled_ids", empty)),
                   sampled_logprobs=tuple(get("sampled_logprobs", empty)),
                   disposition=disposition, housekeeping=housekeeping)

    @property
    def is_housekeeping(self) -> bool:
        return self.housekeeping or self.disposition == HOUSEKEEPING

    def check(self) -> None:
        """Refuse a call whose ids or logprobs cannot be trained on, saying which call and why."""
        where = f"call {self.call_index}"
        if self.disposition not in ("", EXTEND, HOUSEKEEPING) and not self.disposition.startswith(NEW_SEGMENT):
            raise DatumError(f"{where}: unknown disposition {self.disposition!r} (expected {EXTEND!r}, "
                             f"{HOUSEKEEPING!r} or '{NEW_SEGMENT}:<why>')")
        for name in ("prompt_ids", "sampled_ids"):
            bad = [t for t in getattr(self, name) if isinstance(t, bool) or not isinstance(t, int) or t < 0]
            if bad:
                raise DatumError(f"{where}: {name} holds {bad[0]!r}; token ids are non-negative integers")
        if len(self.sampled_logprobs) != len(self.sampled_ids):
            raise DatumError(f"{where}: {len(self.sampled_logprobs)} sampled_logprobs for "
                             f"{len(self.sampled_ids)} sampled_ids; the sampler gives one per token")
        bad_lp = [lp for lp in self.sampled_logprobs if not (isinstance(lp, (int, float)) and math.isfinite(lp))]
        if bad_lp:
            raise DatumError(f"{where}: sampled_logprobs holds {bad_lp[0]!r}; a logprob is a finite number")


@dataclass(frozen=True)
class Segment:
    """A contiguous token stream of one episode with its mask (1 = sampled) and sampler logprobs."""

    call_indices: tuple[int, ...]
    tokens_T: tuple[int, ...]
    mask_T: tuple[int, ...]
    logprobs_T: tuple[float, ...]
    #: Where each call's contribution (its new prompt tokens, then its sampled ones) ends in ``tokens_T``.
    call_ends: tuple[int, ...]

    @property
    def n_sampled(self) -> int:
        return sum(self.mask_T)

    def sampled_ids(self) -> list[int]:
        """The tokens at mask 1, in order: exactly what the sampler returned in this segment."""
        return [t for t, m in zip(self.tokens_T, self.mask_T) if m]


def fold_segments(calls: Iterable[CallLike | Mapping[str, Any]]) -> list[Segment]:
    """The episode's calls (any order) as segments, by the rules in the module docstring."""
    ordered = sorted((CallTokens.of(c) for c in calls), key=lambda c: c.call_index)
    for a, b in zip(ordered, ordered[1:]):
        if a.call_index == b.call_index:
            raise DatumError(f"call_index {a.call_index} appears twice in the episode")
    segments: list[Segment] = []
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    indices: list[int] = []
    ends: list[int] = []

    def close() -> None:
        if indices:
            segments.append(Segment(tuple(indices), tuple(tokens), tuple(mask), tuple(logprobs), tuple(ends)))
        for buf in (tokens, mask, logprobs, indices, ends):
            buf.clear()

    for call in ordered:
        if call.is_housekeeping:
            continue
        call.check()
        n = len(tokens)
        extends = bool(indices) and len(call.prompt_ids) >= n and list(call.prompt_ids[:n]) == tokens
        if call.disposition == EXTEND and not extends:
            raise DatumError(f"call {call.call_index} is marked {EXTEND!r} but its prompt_ids do not start "
                             f"with the segment's {n} tokens so far (calls {indices or 'none'})")
        if extends and not call.disposition.startswith(NEW_SEGMENT):
            added = call.prompt_ids[n:]
        else:
            close()
            if not call.prompt_ids:
                raise DatumError(f"call {call.call_index} starts a segment with an empty prompt: its first "
                                 "sampled token would have nothing to be predicted from")
            added = call.prompt_ids
        tokens += added
        mask += [0] * len(added)
        logprobs += [0.0] * len(added)
        tokens += call.sampled_ids
        mask += [1] * len(call.sampled_ids)
        logprobs += [float(lp) for lp in call.sampled_logprobs]
        indices.append(call.call_index)
        ends.append(len(tokens))
    close()
    return segments


def segment_to_datum(segment: Segment, *, advantage: float | Sequence[float] = 0.0,
                     trace_id: str | None = None, segment_index: int = 0) -> Datum:
    """One segment as a datum by the next-token shift; ``advantage`` is one number or one per sampled token."""
    if len(segment.tokens_T) < 2:
        raise DatumError(f"segment {segment_index} has {len(segment.tokens_T)} token(s); the shift needs two")
    if isinstance(advantage, (int, float)):
        per_sampled = [float(advantage)] * segment.n_sampled
    else:
        per_sampled = [float(a) for a in advantage]
        if len(per_sampled) != segment.n_sampled:
            raise DatumError(f"segment {segment_index}: {len(per_sampled)} advantages for "
                             f"{segment.n_sampled} sampled tokens")
    if not all(math.isfinite(a) for a in per_sampled):
        raise DatumError(f"segment {segment_index}: an advantage is not finite")
    it = iter(per_sampled)
    advantages_T = [next(it) if m else 0.0 for m in segment.mask_T]
    last = len(segment.tokens_T) - 1  # the input stops one short of the end
    chunks, start = [], 0
    for end in segment.call_ends:
        end = min(end, last)
        if end > start:
            chunks.append(EncodedTextChunk(tokens=segment.tokens_T[start:end]))
            start = end
    inputs = LossFnInputs(target_tokens=segment.tokens_T[1:], weights=tuple(float(m) for m in segment.mask_T[1:]),
                          logprobs=segment.logprobs_T[1:], advantages=tuple(advantages_T[1:]))
    return Datum(trace_id=trace_id, segment_index=segment_index, call_indices=segment.call_indices,
                 model_input=ModelInput(chunks=tuple(chunks)), loss_fn_inputs=inputs)


def episode_datums(calls: Iterable[CallLike | Mapping[str, Any]], *, advantage: float | Sequence[float] = 0.0,
                   trace_id: str | None = None) -> list[Datum]:
    """Every trainable datum of one episode: fold, then shift each segment that sampled something.

    ``advantage``: one number for every sampled token, or one per sampled token of the whole episode
    (housekeeping calls excluded), in call order.
    """
    segments = fold_segments(calls)
    total = sum(s.n_sampled for s in segments)
    if not isinstance(advantage, (int, float)) and len(advantage) != total:
        raise DatumError(f"{len(advantage)} advantages for the episode's {total} sampled tokens")
    out, used = [], 0
    for index, segment in enumerate(segments):
        n = segment.n_sampled
        share = advantage if isinstance(advantage, (int, float)) else advantage[used:used + n]
        used += n
        if n:
            out.append(segment_to_datum(segment, advantage=share, trace_id=trace_id, segment_index=index))
    return out
