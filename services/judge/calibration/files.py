"""Hand-ranking files: export traces blind for a person to rank, and read their rankings back.

The export is a CSV with one row per trace: ``trace_id``, ``query``, one column per blind letter
(``A``, ``B``, ...) showing that candidate's sources (titles and snippets only: no URLs, no
provider names), and an empty ``ranking`` column to fill in like ``B > A = C`` (``>`` separates
tiers, best first; ``=`` ties). Letters are shuffled per trace, deterministically from the seed
and trace id. Which letter is which provider is in a separate key CSV (``trace_id``, ``letter``,
``provider``), so the export itself stays blind.
"""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from schemas.trace import Trace
from services.common.errors import ConfigError
from services.judge.base import BlindCandidate
from services.judge.blind import blind
from services.judge.calibration.metrics import Tiers

RANKING_COLUMN = "ranking"
KEY_COLUMNS = ("trace_id", "letter", "provider")
NO_ANSWER = "(no answer)"
_LETTER = re.compile(r"^[A-Z]{1,2}$")


def letter_names(n: int) -> list[str]:
    """``n`` blind labels: A..Z, then AA, AB, ... (at most two letters)."""
    singles = [chr(ord("A") + i) for i in range(26)]
    names = singles + [a + b for a in singles for b in singles]
    if n > len(names):
        raise ValueError(f"at most {len(names)} candidates can be labelled, got {n}")
    return names[:n]


def default_key_path(path: Path) -> Path:
    """Where the key goes by default: ``rank.csv`` -> ``rank.key.csv``."""
    return path.with_name(f"{path.stem}.key{path.suffix or '.csv'}")


def blind_order(trace: Trace, seed: int) -> list[tuple[str, BlindCandidate | None, str]]:
    """(letter, what the person sees, provider) per candidate: the judge's own blinding
    (:func:`services.judge.blind.blind`, shuffled by trace id and ``seed``, names and URLs scrubbed),
    then the failed candidates, which have no answer to show."""
    seen = blind(trace, seed)
    rows: list[tuple[str, BlindCandidate | None, str]] = [
        (c.letter, c, seen.letters[c.letter]) for c in seen.request.candidates]
    extra = letter_names(len(rows) + len(seen.not_shown))[len(rows):]
    return rows + [(letter, None, p) for letter, p in zip(extra, seen.not_shown)]


def _clip(text: str, n: int) -> str:
    """``text`` on one line, cut to about ``n`` characters at a word boundary."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n].rsplit(" ", 1)[0] + " …"


def candidate_cell(candidate: BlindCandidate | None, max_sources: int = 5, max_chars: int = 400) -> str:
    """What the person reads for one candidate: numbered source titles and snippets, nothing else."""
    if candidate is None or not candidate.sources:
        return NO_ANSWER
    lines = []
    for i, c in enumerate(candidate.sources[:max_sources], start=1):
        title, body = _clip(c.title, 200), _clip(c.snippet, max_chars)
        lines.append(f"[{i}] {title} — {body}" if title and body else f"[{i}] {title or body}")
    return "\n".join(lines)


def export_blind(traces: Sequence[Trace], path: Path, n: int, seed: int, *,
                 key_path: Path | None = None, max_sources: int = 5) -> tuple[Path, Path]:
    """Write ``n`` traces (sampled by ``seed``, kept in input order) blind to ``path`` and the key.

    Returns ``(path, key_path)``; the key defaults to :func:`default_key_path`.
    """
    ids = [t.trace_id for t in traces]
    if len(ids) != len(set(ids)):
        raise ValueError("trace ids must be unique to export them")
    picked = sorted(random.Random(seed).sample(range(len(traces)), min(n, len(traces))))
    chosen = [traces[i] for i in picked]
    path, key_path = Path(path), Path(key_path) if key_path else default_key_path(Path(path))
    width = max((len(t.candidates) for t in chosen), default=0)
    with path.open("w", newline="", encoding="utf-8") as out, \
            key_path.open("w", newline="", encoding="utf-8") as key:
        rows = csv.writer(out)
        keys = csv.writer(key)
        rows.writerow(["trace_id", "query", *letter_names(width), RANKING_COLUMN])
        keys.writerow(KEY_COLUMNS)
        for trace in chosen:
            order = blind_order(trace, seed)
            cells = [candidate_cell(c, max_sources) for _, c, _ in order]
            rows.writerow([trace.trace_id, trace.query, *cells, *[""] * (width - len(cells)), ""])
            keys.writerows([trace.trace_id, letter, provider] for letter, _, provider in order)
    return path, key_path


def parse_ranking(text: str, letters: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Tiers of letters from ``"B > A = C"``; ValueError naming the problem.

    Every letter in ``letters`` must appear exactly once; case and spaces do not matter.
    """
    tiers = []
    seen: set[str] = set()
    for part in text.split(">"):
        tier = []
        for token in part.split("="):
            letter = token.strip().upper()
            if not letter:
                raise ValueError(f"empty place in {text!r} (stray '>' or '=')")
            if not _LETTER.match(letter):
                raise ValueError(f"{token.strip()!r} is not a letter (write e.g. 'B > A = C')")
            if letter not in letters:
                raise ValueError(f"letter {letter} is not one of this trace's {', '.join(letters)}")
            if letter in seen:
                raise ValueError(f"letter {letter} appears twice")
            seen.add(letter)
            tier.append(letter)
        tiers.append(tuple(tier))
    missing = [x for x in letters if x not in seen]
    if missing:
        raise ValueError(f"letter(s) {', '.join(missing)} missing: rank every candidate")
    return tuple(tiers)


def _records(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """The non-blank rows of a CSV whose header has ``required``, each with its starting line."""
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in required if c not in header]
        if missing:
            raise ConfigError(f"{path}: line 1: missing column(s) {', '.join(missing)} "
                              f"(header: {', '.join(header) or 'none'})")
        start = reader.line_num + 1
        for row in reader:
            if any(cell.strip() for cell in row):
                if len(row) > len(header):
                    raise ConfigError(f"{path}: line {start}: {len(row)} cells but the header "
                                      f"has {len(header)} columns")
                yield start, dict(zip(header, row))
            start = reader.line_num + 1


def read_key(key_path: Path) -> dict[str, dict[str, str]]:
    """trace_id -> {letter: provider} from a key CSV written by :func:`export_blind`."""
    key_path = Path(key_path)
    key: dict[str, dict[str, str]] = {}
    for line, row in _records(key_path, KEY_COLUMNS):
        trace_id, letter, provider = (row.get(c, "").strip() for c in KEY_COLUMNS)
        if not trace_id or not letter or not provider:
            raise ConfigError(f"{key_path}: line {line}: trace_id, letter and provider are all "
                              f"required")
        letters = key.setdefault(trace_id, {})
        if letter in letters:
            raise ConfigError(f"{key_path}: line {line}: letter {letter} of trace {trace_id} "
                              f"appears twice")
        if provider in letters.values():
            raise ConfigError(f"{key_path}: line {line}: provider {provider} of trace {trace_id} "
                              f"appears twice")
        letters[letter] = provider
    return key


def import_rankings(path: Path, key_path: Path) -> dict[str, Tiers]:
    """trace_id -> provider tiers (best first) from a filled-in export and its key.

    Rows with an empty ``ranking`` are skipped (not ranked yet). Anything else that does not
    parse raises :class:`ConfigError` naming the file, the line and the reason.
    """
    path = Path(path)
    key = read_key(key_path)
    out: dict[str, Tiers] = {}
    for line, row in _records(path, ("trace_id", RANKING_COLUMN)):
        trace_id, text = row.get("trace_id", "").strip(), (row.get(RANKING_COLUMN) or "").strip()
        if not text:
            continue
        if trace_id not in key:
            raise ConfigError(f"{path}: line {line}: trace {trace_id!r} is not in the key "
                              f"{key_path}")
        if trace_id in out:
            raise ConfigError(f"{path}: line {line}: trace {trace_id} is ranked twice")
        letters = key[trace_id]
        try:
            tiers = parse_ranking(text, list(letters))
        except ValueError as exc:
            raise ConfigError(f"{path}: line {line}: {exc}") from None
        out[trace_id] = tuple(tuple(letters[x] for x in tier) for tier in tiers)
    return out
