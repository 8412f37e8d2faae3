"""What every export format's reader shares: the records a reader yields and the shape checks.

A reader yields, in file order, a :class:`Conversation` per usable record, a :class:`Skipped` for a
well-formed record that holds no user+assistant exchange, and a :class:`LineError` for a record
that lacks the format's shape. Inside a reader, :class:`BadShape` and :class:`NoConversation`
say which of the last two a record is; the helpers here raise them with the place that failed.

Only system/user/assistant *text* is kept: tool and function turns, tool-call and tool-result
blocks, images, files and reasoning parts are dropped, and so is a turn left with no text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

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


class NoConversation(Exception):
    """Raised in a reader: the record is well-formed but holds no conversation (a :class:`Skipped`)."""


@dataclass(frozen=True)
class LineError:
    """A record that does not have its format's shape."""

    path: str
    line: int
    message: str
    expected: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} (expected {self.expected})"


class BadShape(Exception):
    """Raised in a reader: the record lacks the format's shape (a :class:`LineError`); the message
    says where."""


Item = Conversation | Skipped | LineError


@dataclass(frozen=True)
class Format:
    """A registered export format: its name, its shape in words (for errors), its reader."""

    name: str
    expected: str
    read: Callable[[Path], Iterator[Item]]


_ROLES: dict[str, Role | None] = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant",
    "tool": None, "function": None, "data": None,
}
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


@contextmanager
def shape_at(where: str) -> Iterator[None]:
    """Prefix a shape error raised inside the block with ``where``."""
    try:
        yield
    except BadShape as exc:
        raise BadShape(f"{where}: {exc}") from None


def json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadShape(f"{what} must be a JSON object, not {kind_of(value)}")
    return value


def json_array(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadShape(f"{what} must be a JSON array, not {kind_of(value)}")
    return value


def kind_of(value: Any) -> str:
    return "missing" if value is None else type(value).__name__


def first_str(*values: Any) -> str | None:
    """The first non-empty string among ``values`` (ids that are numbers count, as text)."""
    for v in values:
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
            return str(v)
    return None


def timestamp(value: Any) -> datetime | None:
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
    raise BadShape(f"unknown role {raw!r}")


def text_of(content: Any) -> str:
    """The text of a message content: a string, or the text parts of a content-part list joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(t for t in map(_part_text, content) if t)
    raise BadShape(f"content must be a string or a list of parts, not {kind_of(content)}")


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    p = json_object(part, "a content part")
    kind = p.get("type", "text")
    if not isinstance(kind, str):
        raise BadShape(f"content part 'type' must be a string, not {kind_of(kind)}")
    if kind not in _TEXT_PARTS:
        return ""  # image, file, tool call/result, reasoning, ...
    if not isinstance(p.get("text"), str):
        raise BadShape(f"{kind!r} part without a string 'text'")
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
    m = json_object(msg, "a message")
    if "role" not in m:
        raise BadShape("message has no 'role'")
    return turn(m["role"], m.get("content"))


def read_turns(messages: Any, what: str, pick: Callable[[Any], Turn | None] = _plain) -> list[Turn]:
    """The kept turns of a message list, each read by ``pick``; errors name the message index."""
    out = []
    for i, msg in enumerate(json_array(messages, what)):
        with shape_at(f"{what}[{i}]"):
            t = pick(msg)
        if t:
            out.append(t)
    return out


def completion_turn(completion: Any, what: str) -> Turn | None:
    """The assistant turn of an OpenAI ``chat.completion`` object (its first choice)."""
    comp = json_object(completion, what)
    choices = json_array(comp.get("choices"), f"{what}.choices")
    if not choices:
        raise BadShape(f"{what}.choices is empty")
    first = json_object(choices[0], f"{what}.choices[0]")
    msg = json_object(first.get("message"), f"{what}.choices[0].message")
    with shape_at(f"{what}.choices[0].message"):
        return turn(msg.get("role", "assistant"), msg.get("content"))


def checked(conv: Conversation) -> Conversation | Skipped:
    """``conv``, or a skip when it lacks a user or an assistant turn."""
    roles = {role for role, _ in conv.messages}
    missing = [r for r in ("user", "assistant") if r not in roles]
    if missing:
        return Skipped(conv.line, f"no {' and no '.join(missing)} turn with text")
    return conv
