"""Blind relabelling: candidates become letters in a per-call shuffle; provider names never leak."""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass

from schemas.trace import Trace
from services.judge.base import BlindCandidate, JudgeRequest, Source


@dataclass(frozen=True)
class Blinded:
    """The judge's view of a trace, and the letter→provider map kept as the audit trail."""

    request: JudgeRequest
    letters: dict[str, str]
    not_shown: tuple[str, ...]
    seed: str


def shuffle_seed(trace_id: str, attempt: int) -> str:
    """The shuffle is derived from (trace id, attempt) so a re-run reproduces it."""
    return hashlib.sha256(f"{trace_id}\x00{attempt}".encode()).hexdigest()[:16]


def blind(trace: Trace, attempt: int = 0, *, hide: tuple[str, ...] = ()) -> Blinded:
    """Letters A, B, … over the candidates that answered, in a seeded shuffle.

    Failed candidates are not shown (there is nothing to grade). Provider names (and ``hide``,
    e.g. provider hosts) are scrubbed from every text the judge sees, and no URL is shown.
    """
    answered = [c for c in trace.candidates if c.ok]
    seed = shuffle_seed(trace.trace_id, attempt)
    random.Random(seed).shuffle(answered)
    scrub = _scrubber(tuple(c.provider for c in trace.candidates) + hide)
    letters = {}
    shown = []
    for letter, cand in zip(string.ascii_uppercase, answered):
        letters[letter] = cand.provider
        sources = tuple(Source(title=scrub(c.title), snippet=scrub(c.snippet)) for c in cand.citations)
        shown.append(BlindCandidate(letter=letter, answer=scrub(cand.answer), sources=sources))
    not_shown = tuple(c.provider for c in trace.candidates if not c.ok)
    return Blinded(JudgeRequest(trace.trace_id, attempt, trace.query, tuple(shown)), letters,
                   not_shown, seed)


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)


def _scrubber(names: tuple[str, ...]):
    """A function that blanks URLs and replaces any of ``names`` (case-insensitive) with a token."""
    words = sorted({n for n in names if n}, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(w) for w in words), re.IGNORECASE) if words else None

    def scrub(text: str) -> str:
        text = _URL.sub("[link]", text)
        return pattern.sub("[source]", text) if pattern else text

    return scrub
