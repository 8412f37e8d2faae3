"""Read a provider ordering out of whatever the router model wrote.

Small models wrap answers in code fences, add prose, number their lines, invent provider names or
leave some out. The parser keeps what it can: the known names in the order given, ``=`` between two
names as a tie, anything else between them as "better than". It fails only when no known name is there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import FanrouteError

_FENCE = re.compile(r"```[\w-]*")
_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_SPLIT = re.compile(r"[>=,;|]")


class UnparseableOrdering(FanrouteError, ValueError):
    """The router's reply names no known provider."""


@dataclass(frozen=True)
class ParsedOrdering:
    """Tiers of known providers, best first; the names it dropped; the providers it left out."""

    tiers: tuple[tuple[str, ...], ...]
    unknown: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def ordering(self) -> tuple[str, ...]:
        """The tiers flattened, best first (ties keep their written order)."""
        return tuple(name for tier in self.tiers for name in tier)


def _name_pattern(providers: Sequence[str]) -> re.Pattern[str]:
    names = sorted(set(providers), key=len, reverse=True)  # longest first: "bm25-all" before "bm25"
    return re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in names) + r")(?![\w-])", re.I)


def _json_lines(text: str) -> str | None:
    """A JSON list of names (or of lists of tied names) as one ``a > b = c`` line."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        return None
    tiers = [" = ".join(map(str, t)) if isinstance(t, list) else str(t) for t in data]
    return " > ".join(tiers)


def parse_ordering(text: str, providers: Sequence[str]) -> ParsedOrdering:
    """The ordering in ``text`` over ``providers``; raises :class:`UnparseableOrdering` when it names none."""
    if not providers:
        raise ValueError("parse_ordering needs at least one provider name")
    canonical = {p.lower(): p for p in providers}
    pattern = _name_pattern(providers)
    body = _FENCE.sub("\n", _THINK.sub(" ", text)).strip()
    body = _json_lines(body) or body
    lines = [ln for ln in body.splitlines() if pattern.search(ln)]
    if not lines:
        raise UnparseableOrdering(f"no known provider in the router's reply {text[:200]!r}")
    counts = [len({m.group(1).lower() for m in pattern.finditer(ln)}) for ln in lines]
    best = max(range(len(lines)), key=lambda i: (counts[i], -i))
    # One name per line (a numbered list) means the lines are the ordering.
    line = lines[best] if counts[best] > 1 else " > ".join(lines)
    run = _best_run(list(pattern.finditer(line)), line)
    tiers: list[list[str]] = []
    seen: set[str] = set()
    for prev, m in zip([None, *run], run):
        name = canonical[m.group(1).lower()]
        if name in seen:
            continue
        seen.add(name)
        between = line[prev.end():m.start()] if prev is not None else ""
        if tiers and "=" in between and ">" not in between:
            tiers[-1].append(name)
        else:
            tiers.append([name])
    unknown = tuple(dict.fromkeys(
        t for part in _SPLIT.split(line) if not pattern.search(part)
        for t in [part.strip(" \t\"'`[]().*0123456789")] if t and " " not in t))
    missing = tuple(p for p in providers if p not in seen)
    return ParsedOrdering(tuple(tuple(t) for t in tiers), unknown, missing)


def _best_run(matches: list[re.Match[str]], line: str) -> list[re.Match[str]]:
    """The stretch with the most names joined by separators (``>``, ``=``, ``,``; at most one stray word
    between two of them), so prose around the ordering is ignored but an unknown name inside it is not."""
    runs: list[list[re.Match[str]]] = [[matches[0]]]
    for prev, m in zip(matches, matches[1:]):
        if all(len(part.split()) <= 1 for part in _SPLIT.split(line[prev.end():m.start()])):
            runs[-1].append(m)
        else:
            runs.append([m])
    return max(runs, key=lambda r: len({m.group(1).lower() for m in r}))
