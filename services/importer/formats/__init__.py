"""Readers of conversation exports, one small reader per product format, registered by name.

A reader yields, in file order, a :class:`Conversation` per usable record, a :class:`Skipped` for a
well-formed record that holds no user+assistant exchange, and a :class:`LineError` for a record
that lacks the format's shape (a whole file that cannot be read raises :class:`ConfigError`).

Only system/user/assistant *text* is kept: tool and function turns, tool-call and tool-result
blocks, images, files and reasoning parts are dropped, and so is a turn left with no text.

The readers live by family: :mod:`.apis` (OpenAI, Anthropic), :mod:`.langsmith`, :mod:`.chats`
(Vercel AI SDK, plain message lists) and :mod:`.csv_rows`, over the shared records and shape checks
of :mod:`.base` and the JSON/JSONL reading of :mod:`.records`. This module is the registry
(:data:`FORMATS`) and :func:`detect_format`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.importer.formats.apis import ANTHROPIC, OPENAI
from services.importer.formats.base import (
    Conversation,
    Format,
    Item,
    LineError,
    Role,
    Skipped,
    Turn,
    role_of,
    text_of,
    turn,
)
from services.importer.formats.chats import MESSAGES, VERCEL
from services.importer.formats.csv_rows import CSV
from services.importer.formats.langsmith import LANGSMITH
from services.importer.formats.records import Record, is_message_list, json_records, jsonl_records

__all__ = [
    "FORMATS", "Conversation", "Format", "Item", "LineError", "Role", "Skipped", "Turn", "detect_format",
    "json_records", "jsonl_records", "role_of", "text_of", "turn",
]

FORMATS: dict[str, Format] = {f.name: f for f in (OPENAI, ANTHROPIC, LANGSMITH, VERCEL, CSV, MESSAGES)}


def detect_format(path: Path) -> str:
    """The format of ``path``, by its extension and then by the shape of its first record."""
    if path.suffix.lower() == ".csv":
        return "csv"
    records = json_records(path, "JSON or JSONL conversation records", is_message_list)
    first = next((r for r in records if isinstance(r, Record)), None)
    name = _sniff(first.data) if first else None
    if name is None:
        raise ConfigError(f"{path}: cannot tell the format from its first record; "
                          f"pass --format (one of {', '.join(FORMATS)})")
    return name


def _sniff(data: Any) -> str | None:
    """The format whose documented shape ``data`` (a first record) has."""
    if isinstance(data, list):
        return "vercel" if any(isinstance(m, dict) and "parts" in m for m in data) else "messages"
    if not isinstance(data, dict):
        return None
    if "request" in data:
        resp, req = data.get("response"), data.get("request")
        anthropic = (isinstance(resp, dict) and resp.get("type") == "message") or (
            isinstance(req, dict) and "system" in req)
        return "anthropic" if anthropic else "openai"
    if "run_type" in data or ("inputs" in data and "outputs" in data):
        return "langsmith"
    msgs = data.get("messages")
    if isinstance(msgs, list):
        ui = "id" in data or any(isinstance(m, dict) and ("parts" in m or "id" in m) for m in msgs)
        return "vercel" if ui else "messages"  # a superset of OpenAI's bare {"messages"} form
    return None
