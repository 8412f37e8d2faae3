"""Reads the judge model's reply into a :class:`JudgeResult`, or says precisely why it cannot.

Models wrap JSON in code fences and prose, so the reply is searched for the first JSON object
that parses and has ``"grades"``. Everything in that object is then checked strictly: a grade
outside 0-3, a fractional grade, a missing, unknown or repeated letter is a failure with its
reason, never a clamped or invented grade.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from services.judge.base import JudgeFailed, JudgeResult

GRADES = range(0, 4)
_DIGITS = re.compile(r"\s*[0-9]{1,3}\s*")
_SHOWN_CHARS = 40


def parse_judgement(text: str, letters: tuple[str, ...]) -> JudgeResult:
    """The grades and tiered ordering in ``text`` for exactly ``letters``; JudgeFailed otherwise."""
    expected = tuple(_letter(x) for x in letters)
    obj = find_judgement_object(text)
    grades = _grades(obj.get("grades"), expected)
    if "ranking" not in obj:
        raise JudgeFailed("judge reply has no 'ranking'")
    ordering = _ordering(obj["ranking"], expected)
    return JudgeResult(grades=grades, ordering=ordering, raw=text)


def find_judgement_object(text: str) -> dict[str, Any]:
    """The first balanced JSON object in ``text`` that parses and has a ``"grades"`` key."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict) and "grades" in value:
            return value
        start = text.find("{", start + 1)  # also looks inside: {"judgement": {"grades": ...}}
    if not text.strip():
        raise JudgeFailed("judge reply is empty")
    raise JudgeFailed(f"no JSON object with 'grades' in the judge reply ({_preview(text)})")


def _grades(value: Any, expected: tuple[str, ...]) -> dict[str, int]:
    """One integer grade 0-3 per expected letter, upper-cased."""
    if not isinstance(value, dict):
        raise JudgeFailed(f"'grades' is {_kind(value)}, not an object")
    grades: dict[str, int] = {}
    for key, raw in value.items():
        letter = _known(key, expected, "grades")
        if letter in grades:
            raise JudgeFailed(f"letter {letter} is graded twice")
        grades[letter] = _grade(letter, raw)
    missing = [x for x in expected if x not in grades]
    if missing:
        raise JudgeFailed(f"no grade for {', '.join(missing)}")
    return {x: grades[x] for x in expected}


def _grade(letter: str, raw: Any) -> int:
    """An integer 0-3 from an int, a whole float or a string of digits; anything else fails."""
    if isinstance(raw, bool):
        number: int | None = None
    elif isinstance(raw, int):
        number = raw
    elif isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        number = int(raw)
    elif isinstance(raw, str) and _DIGITS.fullmatch(raw):
        number = int(raw)
    else:
        number = None
    if number is None:
        raise JudgeFailed(f"grade for {letter} is {_show(raw)}, not an integer 0-3")
    if number not in GRADES:
        raise JudgeFailed(f"grade for {letter} is {number}, outside 0-3")
    return number


def _ordering(value: Any, expected: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Tiers best first; a tier may be a list of letters or one letter; every letter once."""
    if not isinstance(value, list):
        raise JudgeFailed(f"'ranking' is {_kind(value)}, not a list of tiers")
    seen: set[str] = set()
    tiers: list[tuple[str, ...]] = []
    for i, tier in enumerate(value, start=1):
        members = [tier] if isinstance(tier, str) else tier
        if not isinstance(members, list):
            raise JudgeFailed(f"ranking tier {i} is {_kind(tier)}, not a letter or a list")
        letters: list[str] = []
        for item in members:
            letter = _known(item, expected, f"ranking tier {i}")
            if letter in seen:
                raise JudgeFailed(f"letter {letter} appears twice in the ranking")
            seen.add(letter)
            letters.append(letter)
        if letters:  # an empty tier says nothing; dropping it loses nothing
            tiers.append(tuple(letters))
    missing = [x for x in expected if x not in seen]
    if missing:
        raise JudgeFailed(f"ranking misses {', '.join(missing)}")
    return tuple(tiers)


def _known(key: Any, expected: tuple[str, ...], where: str) -> str:
    """``key`` as an upper-case letter that is one of ``expected``."""
    if not isinstance(key, str):
        raise JudgeFailed(f"{where} has {_show(key)}, not a letter")
    letter = _letter(key)
    if letter not in expected:
        raise JudgeFailed(f"{where} has unknown letter {_show(key)} (expected {', '.join(expected)})")
    return letter


def _letter(text: str) -> str:
    return text.strip().upper()


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: Any) -> str:
    """A short printable form of a JSON value for an error message."""
    shown = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return shown if len(shown) <= _SHOWN_CHARS else shown[:_SHOWN_CHARS] + "…"


def _preview(text: str) -> str:
    """The start of the reply on one line, for the failure reason."""
    line = " ".join(text.split())
    return f"{len(text)} chars: {line[:_SHOWN_CHARS]!r}" + ("…" if len(line) > _SHOWN_CHARS else "")
