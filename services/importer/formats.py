"""Readers of conversation exports, one small reader per product format, registered by name.

A reader yields, in file order, a :class:`Conversation` per usable record, a :class:`Skipped` for a
well-formed record that holds no user+assistant exchange, and a :class:`LineError` for a record
that lacks the format's shape (a whole file that cannot be read raises :class:`ConfigError`).

Only system/user/assistant *text* is kept: tool and function turns, tool-call and tool-result
blocks, images, files and reasoning parts are dropped, and so is a turn left with no text.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from services.common.errors import ConfigError

Role = Literal["system", "user", "assistant"]
Turn = tuple[Role, str]


@dataclass(frozen=True)
class Conversation:
    """One conversation as read from an export (not yet redacted)."""

    trace_id: str | None
    messages: list[Turn]
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    line: int = 0


@dataclass(frozen=True)
class Skipped:
    """A well-formed record that gives no episode, and why."""

    line: int
    reason: str


@dataclass(frozen=True)
class LineError:
    """A record that does not have its format's shape."""

    path: str
    line: int
    message: str
    expected: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} (expected {self.expected})"


Item = Conversation | Skipped | LineError


@dataclass(frozen=True)
class Format:
    """A registered export format: its name, its shape in words (for errors), its reader."""

    name: str
    expected: str
    read: Callable[[Path], Iterator[Item]]


class _Bad(Exception):
    """The record does not have the format's shape; the message says where."""


class _Skip(Exception):
    """The record is well-formed but holds no conversation to import."""


# --------------------------------------------------------------------------- shared helpers

_ROLES: dict[str, Role | None] = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant",
    "tool": None, "function": None, "data": None,
}
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


@contextmanager
def _at(where: str) -> Iterator[None]:
    """Prefix a shape error raised inside the block with ``where``."""
    try:
        yield
    except _Bad as exc:
        raise _Bad(f"{where}: {exc}") from None


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what} must be a JSON object, not {_kind(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"{what} must be a JSON array, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return "missing" if value is None else type(value).__name__


def _first_str(*values: Any) -> str | None:
    """The first non-empty string among ``values`` (ids that are numbers count, as text)."""
    for v in values:
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
            return str(v)
    return None


def _when(value: Any) -> datetime | None:
    """A timestamp from epoch seconds/milliseconds or ISO 8601; None when absent or unreadable."""
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return datetime.fromtimestamp(value / 1000 if value > 1e11 else value, UTC)
        if isinstance(value, str) and value:
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        pass
    return None


def role_of(raw: Any) -> Role | None:
    """The episode role of a message role or LangChain type; None for tool/function/data turns."""
    if isinstance(raw, str) and raw.lower() in _ROLES:
        return _ROLES[raw.lower()]
    raise _Bad(f"unknown role {raw!r}")


def text_of(content: Any) -> str:
    """The text of a message content: a string, or the text parts of a content-part list joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(t for t in map(_part_text, content) if t)
    raise _Bad(f"content must be a string or a list of parts, not {_kind(content)}")


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    p = _obj(part, "a content part")
    kind = p.get("type", "text")
    if not isinstance(kind, str):
        raise _Bad(f"content part 'type' must be a string, not {_kind(kind)}")
    if kind not in _TEXT_PARTS:
        return ""  # image, file, tool call/result, reasoning, ...
    if not isinstance(p.get("text"), str):
        raise _Bad(f"{kind!r} part without a string 'text'")
    return p["text"]


def turn(role: Any, content: Any) -> Turn | None:
    """One (role, text) turn; None for a tool turn or a turn with no text."""
    mapped = role_of(role)
    if mapped is None:
        return None
    text = text_of(content)
    return (mapped, text) if text.strip() else None


def _plain(msg: Any) -> Turn | None:
    """A ``{"role", "content"}`` message (OpenAI, Anthropic, CoreMessage, plain lists)."""
    m = _obj(msg, "a message")
    if "role" not in m:
        raise _Bad("message has no 'role'")
    return turn(m["role"], m.get("content"))


def _turns(messages: Any, what: str, pick: Callable[[Any], Turn | None] = _plain) -> list[Turn]:
    """The kept turns of a message list, each read by ``pick``; errors name the message index."""
    out = []
    for i, msg in enumerate(_list(messages, what)):
        with _at(f"{what}[{i}]"):
            t = pick(msg)
        if t:
            out.append(t)
    return out


def _choice(completion: Any, what: str) -> Turn | None:
    """The assistant turn of an OpenAI ``chat.completion`` object (its first choice)."""
    comp = _obj(completion, what)
    choices = _list(comp.get("choices"), f"{what}.choices")
    if not choices:
        raise _Bad(f"{what}.choices is empty")
    msg = _obj(_obj(choices[0], f"{what}.choices[0]").get("message"), f"{what}.choices[0].message")
    with _at(f"{what}.choices[0].message"):
        return turn(msg.get("role", "assistant"), msg.get("content"))


def _checked(conv: Conversation) -> Conversation | Skipped:
    """``conv``, or a skip when it lacks a user or an assistant turn."""
    roles = {role for role, _ in conv.messages}
    missing = [r for r in ("user", "assistant") if r not in roles]
    if missing:
        return Skipped(conv.line, f"no {' and no '.join(missing)} turn with text")
    return conv


# --------------------------------------------------------------------------- JSON records

@dataclass(frozen=True)
class _Record:
    line: int
    data: Any


_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_ITEM_GAP = re.compile(r"[\s,]*")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _lines(text: str) -> list[str]:
    """Lines split at newlines only (``str.splitlines`` also splits at U+2028, legal inside JSON strings)."""
    return text.split("\n")


def jsonl_records(path: Path, expected: str, text: str | None = None) -> Iterator[_Record | LineError]:
    """One record per non-blank line; a line that is not JSON is a :class:`LineError`."""
    for n, line in enumerate(_lines(_read_text(path) if text is None else text), 1):
        if not line.strip():
            continue
        try:
            yield _Record(n, json.loads(line))
        except json.JSONDecodeError as exc:
            yield LineError(str(path), n, f"not valid JSON ({exc.msg} at column {exc.colno})", expected)


def json_records(path: Path, expected: str,
                 whole: Callable[[list[Any]], bool] | None = None) -> Iterator[_Record | LineError]:
    """Records of a JSONL file, of a JSON array (one per item, at its line) or of one JSON object.

    An array for which ``whole`` is true is one record (a bare message list is one conversation).
    """
    text = _read_text(path)
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
        yield _Record(text.count("\n", 0, len(text) - len(text.lstrip())) + 1, doc)
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


def _array_items(text: str) -> Iterator[_Record]:
    """The items of a (valid) top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0
    while True:
        pos = _ITEM_GAP.match(text, pos).end()
        if text[pos] == "]":
            return
        value, end = decoder.raw_decode(text, pos)
        line, counted = line + text.count("\n", counted, pos), pos
        yield _Record(line, value)
        pos = end


def _is_message_list(doc: list[Any]) -> bool:
    """A top-level array of messages (one conversation) rather than of records."""
    return bool(doc) and isinstance(doc[0], dict) and "role" in doc[0]


def _json_format(name: str, expected: str, convert: Callable[[Any], Conversation], *,
                 whole: Callable[[list[Any]], bool] | None = None,
                 select: Callable[[Iterable[Item]], Iterable[Item]] | None = None) -> Format:
    """A format whose records are JSON values, each turned into a conversation by ``convert``."""
    def read(path: Path) -> Iterator[Item]:
        items = (_convert(path, expected, rec, convert) for rec in json_records(path, expected, whole))
        yield from select(items) if select else items
    return Format(name, expected, read)


def _convert(path: Path, expected: str, rec: _Record | LineError,
             convert: Callable[[Any], Conversation]) -> Item:
    if isinstance(rec, LineError):
        return rec
    try:
        return _checked(replace(convert(rec.data), line=rec.line))
    except _Bad as exc:
        return LineError(str(path), rec.line, str(exc), expected)
    except _Skip as exc:
        return Skipped(rec.line, str(exc))


# --------------------------------------------------------------------------- openai

def _openai(rec: Any) -> Conversation:
    """``{"request": {"model", "messages"}, "response": chat.completion}`` or bare ``{"messages"}``."""
    r = _obj(rec, "a record")
    if "request" in r:
        request, response, where = _obj(r["request"], "request"), r.get("response"), "request.messages"
    elif "messages" in r:
        request, response, where = r, None, "messages"
    else:
        raise _Bad('neither "request" nor "messages"')
    turns = _turns(request.get("messages"), where)
    reply = _choice(response, "response") if response is not None else None
    resp = response if isinstance(response, dict) else {}
    metadata = request.get("metadata") or r.get("metadata")
    trace = _first_str(resp.get("id"), metadata.get("trace_id") if isinstance(metadata, dict) else None)
    meta = {k: v for k, v in {"model": resp.get("model") or request.get("model"),
                              "metadata": metadata}.items() if v}
    return Conversation(trace, turns + [reply] if reply else turns, meta, _when(resp.get("created")))


# --------------------------------------------------------------------------- anthropic

def _anthropic(rec: Any) -> Conversation:
    """``{"request": {"model", "system", "messages"}, "response": Messages API message}``."""
    r = _obj(rec, "a record")
    request, response = _obj(r.get("request"), "request"), r.get("response")
    with _at("request.system"):
        system = text_of(request.get("system"))
    turns: list[Turn] = [("system", system)] if system.strip() else []
    turns += _turns(request.get("messages"), "request.messages")
    resp = {} if response is None else _obj(response, "response")
    if resp.get("type") == "message":
        with _at("response.content"):
            reply = turn(resp.get("role", "assistant"), resp.get("content"))
        turns += [reply] if reply else []
    elif resp and resp.get("type") != "error":
        raise _Bad(f"response.type is {resp.get('type')!r}, not 'message'")
    meta = {k: v for k, v in {"model": resp.get("model") or request.get("model"),
                              "stop_reason": resp.get("stop_reason")}.items() if v}
    return Conversation(_first_str(resp.get("id"), r.get("trace_id")), turns, meta)


# --------------------------------------------------------------------------- langsmith

_PREFERRED_INPUTS = ("input", "question", "query", "prompt")
_PREFERRED_OUTPUTS = ("output", "answer", "result", "text")


def _lc_message(msg: Any) -> Turn | None:
    """A LangChain message: serialized ``{"lc": 1, "id": [..., "HumanMessage"], "kwargs"}``,
    ``{"type", "data"}`` (messages_to_dict) or plain ``{"type"|"role", "content"}``."""
    m = _obj(msg, "a message")
    if m.get("lc") == 1 and "kwargs" in m:
        ident = _list(m.get("id"), "id")
        if not ident:
            raise _Bad("serialized message with an empty 'id'")
        kind: Any = str(ident[-1]).removesuffix("Chunk").removesuffix("Message").lower()
        body = _obj(m["kwargs"], "kwargs")
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
    ins = _obj(inputs, "inputs")
    if "messages" in ins:
        msgs = ins["messages"]
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], list):
            msgs = msgs[0]  # the tracer records one message list per prompt of the batch
        return _turns(msgs, "inputs.messages", _lc_message)
    prompts = ins.get("prompts")
    text = prompts[0] if isinstance(prompts, list) and prompts else _single_text(ins, _PREFERRED_INPUTS)
    if not isinstance(text, str):
        raise _Skip("inputs hold no messages and no single text input")
    return [("user", text)] if text.strip() else []


def _ls_output(outputs: Any) -> Turn | None:
    """The assistant turn of a run's outputs: generations, a chat.completion, messages or text."""
    if outputs is None:
        raise _Skip("run has no outputs")
    outs = _obj(outputs, "outputs")
    if "generations" in outs:
        gens = _list(outs["generations"], "outputs.generations")
        first = gens[0] if gens else None
        first = (first[0] if first else None) if isinstance(first, list) else first
        gen = _obj(first, "outputs.generations[0]")
        with _at("outputs.generations[0]"):
            return _lc_message(gen["message"]) if "message" in gen else turn("ai", gen.get("text"))
    if "choices" in outs:
        return _choice(outs, "outputs")
    if "messages" in outs:
        replies = [t for t in _turns(outs["messages"], "outputs.messages", _lc_message) if t[0] == "assistant"]
        return replies[-1] if replies else None
    if isinstance(outs.get("output"), dict):
        with _at("outputs.output"):
            return _lc_message(outs["output"])
    text = _single_text(outs, _PREFERRED_OUTPUTS)
    return ("assistant", text) if text and text.strip() else None


def _langsmith(rec: Any) -> Conversation:
    """A LangSmith Run: ``id``, ``trace_id``, ``run_type``, ``inputs``, ``outputs``."""
    run = _obj(rec, "a run")
    kind = run.get("run_type")
    if not isinstance(kind, str):
        raise _Bad('no "run_type"')
    if kind not in ("llm", "chain"):
        raise _Skip(f"run_type {kind!r} (only llm and chain runs hold conversations)")
    turns = _ls_inputs(run.get("inputs"))
    reply = _ls_output(run.get("outputs"))
    meta = {k: v for k, v in {"run_id": run.get("id"), "run_type": kind, "name": run.get("name"),
                              "parent_run_id": run.get("parent_run_id"),
                              "order": run.get("dotted_order") or run.get("start_time")}.items() if v}
    return Conversation(_first_str(run.get("trace_id"), run.get("id")), turns + [reply] if reply else turns,
                        meta, _when(run.get("start_time")))


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


# --------------------------------------------------------------------------- vercel

def _ui_message(msg: Any) -> Turn | None:
    """A UIMessage ``{"id", "role", "parts"}`` (AI SDK 5) or Message/CoreMessage ``{"role", "content"}``."""
    m = _obj(msg, "a message")
    if "role" not in m:
        raise _Bad("message has no 'role'")
    return turn(m["role"], m["parts"] if isinstance(m.get("parts"), list) else m.get("content"))


def _vercel(rec: Any) -> Conversation:
    """A chat ``{"id", "messages": [...]}`` (useChat's request body) or a bare message array."""
    chat = {"messages": rec} if isinstance(rec, list) else _obj(rec, "a chat")
    messages = _list(chat.get("messages"), "messages")
    turns = _turns(messages, "messages", _ui_message)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    stamps = [t for m in messages if isinstance(m, dict) and (t := _when(m.get("createdAt")))]
    meta = {"chat_id": chat["id"]} if chat.get("id") else {}
    return Conversation(_first_str(chat.get("id"), last.get("id")), turns, meta, max(stamps, default=None))


# --------------------------------------------------------------------------- messages

def _messages(rec: Any) -> Conversation:
    """``[{"role", "content"}, ...]`` or ``{"messages": [...], "trace_id"?}``."""
    if isinstance(rec, list):
        return Conversation(None, _turns(rec, "messages"))
    r = _obj(rec, 'a message list or {"messages": [...]}')
    return Conversation(_first_str(r.get("trace_id")), _turns(r.get("messages"), "messages"))


# --------------------------------------------------------------------------- csv

_CSV_EXPECTED = "CSV with a header naming user,assistant (or query,response), optional system and trace_id"
_CSV_PAIRS = (("user", "assistant"), ("query", "response"))
_CSV_ROLES: tuple[Role, ...] = ("system", "user", "assistant")


def _read_csv(path: Path) -> Iterator[Item]:
    """Rows of a CSV with a header: system (optional), user, assistant, trace_id (optional)."""
    rows = csv.reader(io.StringIO(_read_text(path), newline=""))
    header = [h.strip().lower() for h in next(rows, [])]
    pair = next(((u, a) for u, a in _CSV_PAIRS if u in header and a in header), None)
    if pair is None:
        raise ConfigError(f"{path}:1: header {header} names neither user,assistant nor query,response; "
                          f"expected {_CSV_EXPECTED}")
    used = {"system", "trace_id", *pair}
    while True:
        line = rows.line_num + 1
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as exc:
            yield LineError(str(path), line, f"unreadable CSV row ({exc})", _CSV_EXPECTED)
            continue
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            yield LineError(str(path), line, f"{len(row)} fields, the header has {len(header)}", _CSV_EXPECTED)
            continue
        cells = dict(zip(header, row, strict=True))
        turns = [(role, cells.get(col, "")) for role, col in zip(_CSV_ROLES, ("system", *pair), strict=True)]
        yield _checked(Conversation(cells.get("trace_id") or None, [t for t in turns if t[1].strip()],
                                    {k: v for k, v in cells.items() if k not in used and v}, line=line))


# --------------------------------------------------------------------------- registry

FORMATS: dict[str, Format] = {f.name: f for f in (
    _json_format("openai", 'JSONL of {"request": {"model", "messages"}, "response": chat.completion} '
                           'or {"messages": [...]} (OpenAI fine-tuning chat format)', _openai),
    _json_format("anthropic", 'JSONL of {"request": {"model", "system", "messages"}, '
                              '"response": {"type": "message", "content": [...]}}', _anthropic),
    _json_format("langsmith", 'LangSmith runs (JSON array or JSONL of Run objects with '
                              '"id", "trace_id", "run_type", "inputs", "outputs")', _langsmith,
                 select=_one_per_trace),
    _json_format("vercel", 'Vercel AI SDK chats: {"id", "messages": [UIMessage or Message...]} '
                           '(JSON array or JSONL), or one JSON array of messages', _vercel,
                 whole=_is_message_list),
    Format("csv", _CSV_EXPECTED, _read_csv),
    _json_format("messages", 'message lists: a JSON array of [{"role", "content"}...] conversations, '
                             'or JSONL of {"messages": [...]} or [...] per line', _messages,
                 whole=_is_message_list),
)}


def detect_format(path: Path) -> str:
    """The format of ``path``, by its extension and then by the shape of its first record."""
    if path.suffix.lower() == ".csv":
        return "csv"
    records = json_records(path, "JSON or JSONL conversation records", _is_message_list)
    first = next((r for r in records if isinstance(r, _Record)), None)
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
