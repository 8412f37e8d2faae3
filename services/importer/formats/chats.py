"""Chat transcripts: Vercel AI SDK chats and plain message lists."""

from __future__ import annotations

from typing import Any

from services.importer.formats.base import (
    BadShape,
    Conversation,
    Turn,
    first_str,
    json_array,
    json_object,
    read_turns,
    timestamp,
    turn,
)
from services.importer.formats.records import is_message_list, json_format


def _ui_message(msg: Any) -> Turn | None:
    """A UIMessage ``{"id", "role", "parts"}`` (AI SDK 5) or Message/CoreMessage ``{"role", "content"}``."""
    m = json_object(msg, "a message")
    if "role" not in m:
        raise BadShape("message has no 'role'")
    return turn(m["role"], m["parts"] if isinstance(m.get("parts"), list) else m.get("content"))


def _vercel(rec: Any) -> Conversation:
    """A chat ``{"id", "messages": [...]}`` (useChat's request body) or a bare message array."""
    chat = {"messages": rec} if isinstance(rec, list) else json_object(rec, "a chat")
    messages = json_array(chat.get("messages"), "messages")
    turns = read_turns(messages, "messages", _ui_message)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    stamps = [t for m in messages if isinstance(m, dict) and (t := timestamp(m.get("createdAt")))]
    meta = {"chat_id": chat["id"]} if chat.get("id") else {}
    return Conversation(first_str(chat.get("id"), last.get("id")), turns, meta, max(stamps, default=None))


def _messages(rec: Any) -> Conversation:
    """``[{"role", "content"}, ...]`` or ``{"messages": [...], "trace_id"?}``."""
    if isinstance(rec, list):
        return Conversation(None, read_turns(rec, "messages"))
    r = json_object(rec, 'a message list or {"messages": [...]}')
    return Conversation(first_str(r.get("trace_id")), read_turns(r.get("messages"), "messages"))


VERCEL = json_format("vercel", 'Vercel AI SDK chats: {"id", "messages": [UIMessage or Message...]} '
                               '(JSON array or JSONL), or one JSON array of messages', _vercel,
                     whole=is_message_list)
MESSAGES = json_format("messages", 'message lists: a JSON array of [{"role", "content"}...] conversations, '
                                   'or JSONL of {"messages": [...]} or [...] per line', _messages,
                       whole=is_message_list)
