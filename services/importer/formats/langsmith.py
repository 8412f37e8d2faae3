"""LangSmith runs: a conversation per trace, from its LLM and chain runs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from services.importer.formats.base import (
    BadShape,
    Conversation,
    Item,
    NoConversation,
    Skipped,
    Turn,
    completion_turn,
    first_str,
    json_array,
    json_object,
    read_turns,
    shape_at,
    timestamp,
    turn,
)
from services.importer.formats.records import json_format

_PREFERRED_INPUTS = ("input", "question", "query", "prompt")
_PREFERRED_OUTPUTS = ("output", "answer", "result", "text")


def _lc_message(msg: Any) -> Turn | None:
    """A LangChain message: serialized ``{"lc": 1, "id": [..., "HumanMessage"], "kwargs"}``,
    ``{"type", "data"}`` (messages_to_dict) or plain ``{"type"|"role", "content"}``."""
    m = json_object(msg, "a message")
    if m.get("lc") == 1 and "kwargs" in m:
        ident = json_array(m.get("id"), "id")
        if not ident:
            raise BadShape("serialized message with an empty 'id'")
        kind: Any = str(ident[-1]).removesuffix("Chunk").removesuffix("Message").lower()
        body = json_object(m["kwargs"], "kwargs")
    elif isinstance(m.get("data"), dict):
        kind, body = m.get("type"), m["data"]
    else:
        kind, body = m.get("role", m.get("type")), m
    return turn(body.get("role") if kind == "chat" else kind, body.get("content"))


def _single_text(values: dict[str, Any], preferred: tuple[str, ...]) -> str | None:
    """The text among a chain's inputs or outputs: a preferred key, or the only key."""
    for key in preferred:
        if isinstance(values.get(key), str):
            return values[key]
    only = next(iter(values.values())) if len(values) == 1 else None
    return only if isinstance(only, str) else None


def _ls_inputs(inputs: Any) -> list[Turn]:
    """Turns of a run's inputs: LangChain/OpenAI messages, LLM prompts or one text input."""
    ins = json_object(inputs, "inputs")
    if "messages" in ins:
        msgs = ins["messages"]
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], list):
            msgs = msgs[0]  # the tracer records one message list per prompt of the batch
        return read_turns(msgs, "inputs.messages", _lc_message)
    prompts = ins.get("prompts")
    text = prompts[0] if isinstance(prompts, list) and prompts else _single_text(ins, _PREFERRED_INPUTS)
    if not isinstance(text, str):
        raise NoConversation("inputs hold no messages and no single text input")
    return [("user", text)] if text.strip() else []


def _ls_output(outputs: Any) -> Turn | None:
    """The assistant turn of a run's outputs: generations, a chat.completion, messages or text."""
    if outputs is None:
        raise NoConversation("run has no outputs")
    outs = json_object(outputs, "outputs")
    if "generations" in outs:
        gens = json_array(outs["generations"], "outputs.generations")
        first = gens[0] if gens else None
        first = (first[0] if first else None) if isinstance(first, list) else first
        gen = json_object(first, "outputs.generations[0]")
        with shape_at("outputs.generations[0]"):
            return _lc_message(gen["message"]) if "message" in gen else turn("ai", gen.get("text"))
    if "choices" in outs:
        return completion_turn(outs, "outputs")
    if "messages" in outs:
        said = read_turns(outs["messages"], "outputs.messages", _lc_message)
        replies = [t for t in said if t[0] == "assistant"]
        return replies[-1] if replies else None
    if isinstance(outs.get("output"), dict):
        with shape_at("outputs.output"):
            return _lc_message(outs["output"])
    text = _single_text(outs, _PREFERRED_OUTPUTS)
    return ("assistant", text) if text and text.strip() else None


def _langsmith(rec: Any) -> Conversation:
    """A LangSmith Run: ``id``, ``trace_id``, ``run_type``, ``inputs``, ``outputs``."""
    run = json_object(rec, "a run")
    kind = run.get("run_type")
    if not isinstance(kind, str):
        raise BadShape('no "run_type"')
    if kind not in ("llm", "chain"):
        raise NoConversation(f"run_type {kind!r} (only llm and chain runs hold conversations)")
    turns = _ls_inputs(run.get("inputs"))
    reply = _ls_output(run.get("outputs"))
    meta = {k: v for k, v in {"run_id": run.get("id"), "run_type": kind, "name": run.get("name"),
                              "parent_run_id": run.get("parent_run_id"),
                              "order": run.get("dotted_order") or run.get("start_time")}.items() if v}
    return Conversation(first_str(run.get("trace_id"), run.get("id")), turns + [reply] if reply else turns,
                        meta, timestamp(run.get("start_time")))


def _one_per_trace(items: Iterable[Item]) -> Iterator[Item]:
    """One conversation per trace: the root run's if it has one, else the last run's.

    An exported trace holds its root run and the runs under it, and each would be an episode with
    the same trace id (so the same episode id).
    """
    items = list(items)
    chosen: dict[str, Conversation] = {}
    for item in items:
        if isinstance(item, Conversation) and item.trace_id:
            best = chosen.get(item.trace_id)
            if best is None or _run_rank(item) >= _run_rank(best):
                chosen[item.trace_id] = item
    for item in items:
        keep = chosen.get(item.trace_id) if isinstance(item, Conversation) and item.trace_id else item
        yield item if keep is item else Skipped(
            item.line, f"another run of trace {item.trace_id} is imported (line {keep.line})")


def _run_rank(conv: Conversation) -> tuple[bool, str, int]:
    root = conv.meta.get("run_id") == conv.trace_id or not conv.meta.get("parent_run_id")
    return root, str(conv.meta.get("order", "")), conv.line


LANGSMITH = json_format("langsmith", 'LangSmith runs (JSON array or JSONL of Run objects with '
                                     '"id", "trace_id", "run_type", "inputs", "outputs")', _langsmith,
                        select=_one_per_trace)
