"""JSON and JSONL records of an export file, each with the line it starts on, and the
:class:`~services.importer.formats.base.Format` of a format whose records are JSON values."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.importer.formats.base import (
    BadShape,
    Conversation,
    Format,
    Item,
    LineError,
    NoConversation,
    Skipped,
    checked,
)


@dataclass(frozen=True)
class Record:
    line: int
    data: Any


_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_ITEM_GAP = re.compile(r"[\s,]*")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _lines(text: str) -> list[str]:
    """Lines split at newlines only (``str.splitlines`` also splits at U+2028, legal inside JSON strings)."""
    return text.split("\n")


def jsonl_records(path: Path, expected: str, text: str | None = None) -> Iterator[Record | LineError]:
    """One record per non-blank line; a line that is not JSON is a :class:`LineError`."""
    for n, line in enumerate(_lines(read_text(path) if text is None else text), 1):
        if not line.strip():
            continue
        try:
            yield Record(n, json.loads(line))
        except json.JSONDecodeError as exc:
            yield LineError(str(path), n, f"not valid JSON ({exc.msg} at column {exc.colno})", expected)


def json_records(path: Path, expected: str,
                 whole: Callable[[list[Any]], bool] | None = None) -> Iterator[Record | LineError]:
    """Records of a JSONL file, of a JSON array (one per item, at its line) or of one JSON object.

    An array for which ``whole`` is true is one record (a bare message list is one conversation).
    """
    text = read_text(path)
    if path.suffix.lower() in _JSONL_SUFFIXES:
        yield from jsonl_records(path, expected, text)
        return
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if _looks_like_jsonl(text):
            yield from jsonl_records(path, expected, text)
            return
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                          f"expected {expected}") from exc
    if isinstance(doc, list) and not (whole and whole(doc)):
        yield from _array_items(text)
    elif isinstance(doc, (dict, list)):
        yield Record(text.count("\n", 0, len(text) - len(text.lstrip())) + 1, doc)
    else:
        raise ConfigError(f"{path}:1: a JSON {type(doc).__name__}, not an object or array; "
                          f"expected {expected}")


def _looks_like_jsonl(text: str) -> bool:
    """True when the first non-blank line is a JSON object or array on its own."""
    first = next((ln for ln in _lines(text) if ln.strip()), "")
    try:
        return isinstance(json.loads(first), (dict, list))
    except json.JSONDecodeError:
        return False


def _array_items(text: str) -> Iterator[Record]:
    """The items of a (valid) top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0
    while True:
        pos = _ITEM_GAP.match(text, pos).end()
        if text[pos] == "]":
            return
        value, end = decoder.raw_decode(text, pos)
        line, counted = line + text.count("\n", counted, pos), pos
        yield Record(line, value)
        pos = end


def is_message_list(doc: list[Any]) -> bool:
    """A top-level array of messages (one conversation) rather than of records."""
    return bool(doc) and isinstance(doc[0], dict) and "role" in doc[0]


def json_format(name: str, expected: str, convert: Callable[[Any], Conversation], *,
                 whole: Callable[[list[Any]], bool] | None = None,
                 select: Callable[[Iterable[Item]], Iterable[Item]] | None = None) -> Format:
    """A format whose records are JSON values, each turned into a conversation by ``convert``."""
    def read(path: Path) -> Iterator[Item]:
        items = (_convert(path, expected, rec, convert) for rec in json_records(path, expected, whole))
        yield from select(items) if select else items
    return Format(name, expected, read)


def _convert(path: Path, expected: str, rec: Record | LineError,
             convert: Callable[[Any], Conversation]) -> Item:
    if isinstance(rec, LineError):
        return rec
    try:
        return checked(replace(convert(rec.data), line=rec.line))
    except BadShape as exc:
        return LineError(str(path), rec.line, str(exc), expected)
    except NoConversation as exc:
        return Skipped(rec.line, str(exc))
