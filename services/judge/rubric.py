"""The judge's rubric (versioned; its hash goes on every verdict) and the prompt built from it."""

from __future__ import annotations

import hashlib

from services.judge.base import JudgeRequest

RUBRIC_VERSION = "umbrela-listwise-v1"

SYSTEM = """You are a search quality rater. You judge how well each candidate answer, with the \
sources it cites, answers the user's query. Candidates are labelled with letters; you know nothing \
else about where they came from, and you must not guess.

Grade every candidate on this scale (UMBRELA):
3 = the answer is dedicated to the query and answers it
2 = the answer partly answers the query
1 = the answer is related to the query but does not answer it
0 = the answer has nothing to do with the query (or is empty)

Then order all candidates from best to worst. Candidates of equal quality share a tier: do not \
invent an order between answers that are equally good.

Reply with one JSON object and nothing else, in exactly this shape:
{"grades": {"A": 0, "B": 0}, "ranking": [["A"], ["B"]]}
"grades" has every letter once with an integer 0-3; "ranking" is a list of tiers, best first, and \
every letter appears in exactly one tier."""


def render_user(request: JudgeRequest, *, max_sources: int = 5, max_chars: int = 600) -> str:
    """The user turn: the query, then each lettered candidate with its answer and sources."""
    parts = [f"Query: {request.query}", ""]
    for cand in request.candidates:
        parts.append(f"=== Candidate {cand.letter} ===")
        parts.append(f"Answer: {_clip(cand.answer, max_chars) or '(empty)'}")
        for i, src in enumerate(cand.sources[:max_sources], start=1):
            parts.append(f"Source {i}: {_clip(src.title, 200)} — {_clip(src.snippet, max_chars)}")
        parts.append("")
    parts.append(f"Letters: {', '.join(request.letters)}. Reply with the JSON object only.")
    return "\n".join(parts)


def rubric_hash(extra: str = "") -> str:
    """Hash of the rubric text and version (plus backend-specific prompt parts, if any)."""
    return hashlib.sha256(f"{RUBRIC_VERSION}\n{SYSTEM}\n{extra}".encode()).hexdigest()[:16]


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n].rsplit(" ", 1)[0] + " …"
