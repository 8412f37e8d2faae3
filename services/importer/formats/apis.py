"""Request/response logs of the LLM APIs: OpenAI chat completions and Anthropic messages."""

from __future__ import annotations

from typing import Any

from services.importer.formats.base import (
    BadShape,
    Conversation,
    Turn,
    completion_turn,
    first_str,
    json_object,
    read_turns,
    shape_at,
    text_of,
    timestamp,
    turn,
)
from services.importer.formats.records import json_format


def _openai(rec: Any) -> Conversation:
    """``{"request": {"model", "messages"}, "response": chat.completion}`` or bare ``{"messages"}``."""
    r = json_object(rec, "a record")
    if "request" in r:
        request, response, where = json_object(r["request"], "request"), r.get("response"), "request.messages"
    elif "messages" in r:
        request, response, where = r, None, "messages"
    else:
        raise BadShape('neither "request" nor "messages"')
    turns = read_turns(request.get("messages"), where)
    reply = completion_turn(response, "response") if response is not None else None
    resp = response if isinstance(response, dict) else {}
    metadata = request.get("metadata") or r.get("metadata")
    trace = first_str(resp.get("id"), metadata.get("trace_id") if isinstance(metadata, dict) else None)
    meta = {k: v for k, v in {"model": resp.get("model") or request.get("model"),
                              "metadata": metadata}.items() if v}
    return Conversation(trace, turns + [reply] if reply else turns, meta, timestamp(resp.get("created")))


def _anthropic(rec: Any) -> Conversation:
    """``{"request": {"model", "system", "messages"}, "response": Messages API message}``."""
    r = json_object(rec, "a record")
    request, response = json_object(r.get("request"), "request"), r.get("response")
    with shape_at("request.system"):
        system = text_of(request.get("system"))
    turns: list[Turn] = [("system", system)] if system.strip() else []
    turns += read_turns(request.get("messages"), "request.messages")
    resp = {} if response is None else json_object(response, "response")
    if resp.get("type") == "message":
        with shape_at("response.content"):
            reply = turn(resp.get("role", "assistant"), resp.get("content"))
        turns += [reply] if reply else []
    elif resp and resp.get("type") != "error":
        raise BadShape(f"response.type is {resp.get('type')!r}, not 'message'")
    meta = {k: v for k, v in {"model": resp.get("model") or request.get("model"),
                              "stop_reason": resp.get("stop_reason")}.items() if v}
    return Conversation(first_str(resp.get("id"), r.get("trace_id")), turns, meta)


OPENAI = json_format("openai", 'JSONL of {"request": {"model", "messages"}, "response": chat.completion} '
                               'or {"messages": [...]} (OpenAI fine-tuning chat format)', _openai)
ANTHROPIC = json_format("anthropic", 'JSONL of {"request": {"model", "system", "messages"}, '
                                     '"response": {"type": "message", "content": [...]}}', _anthropic)
