"""What both wire formats become inside the relay: a conversation, sampling parameters, a reply.

Messages are normalised chat-template dicts: ``{"role", "content": str}``, plus ``tool_calls``
(``[{"id", "name", "arguments": {...}}]``) on an assistant turn and ``tool_call_id`` on a ``tool`` turn.
The same normalisation is applied to a reply the relay returns and to that reply when the harness
sends it back, so the two compare equal exactly when the harness did not change it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from services.common.errors import FanrouteError

Wire = Literal["openai", "anthropic"]


class Loose(BaseModel):
    """A wire body or part of one: the fields the relay reads are typed, any others are accepted."""

    model_config = ConfigDict(extra="allow")


class BadRequest(FanrouteError):
    """A request the relay refuses: status (4xx), error kind, reason, and the offending field."""

    def __init__(self, reason: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request") -> None:
        super().__init__(reason)
        top = param.split("[")[0].split(".")[0] if param else None  # the body's field: messages, stop, ...
        self.status, self.kind, self.reason, self.param = status, kind, reason, top


@dataclass(frozen=True)
class Sampling:
    """What the sampler is asked for (``None`` = the sampler's default)."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # OpenAI's logprobs=true: this many alternatives per token


@dataclass(frozen=True)
class ChatRequest:
    """One harness request in either wire format, normalised."""

    wire: Wire
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    raw: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> tuple[str, str]:
        """(system prompt, last user message): what housekeeping rules are matched against."""
        system = "\n".join(m["content"] for m in self.messages if m["role"] == "system")
        user = next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")
        return system, user


@dataclass(frozen=True)
class Reply:
    """What the sampler produced, as the harness will see it."""

    text: str
    tool_calls: list[dict[str, Any]]
    finish_reason: Literal["stop", "length"]
    stop_reason: str | int | None
    sampled_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    prompt_tokens: int

    def message(self) -> dict[str, Any]:
        """The reply as a normalised assistant message (what the harness should send back)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def tool_call(call_id: str, name: str, arguments: Any, where: str) -> dict[str, Any]:
    """A normalised tool call; ``arguments`` as a JSON object (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{where}: arguments are not JSON: {exc}", where) from exc
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}: arguments must be a JSON object", where)
    return {"id": call_id, "name": name, "arguments": arguments}


def check_stop(stop: list[str], limit: int, param: str) -> tuple[str, ...]:
    if len(stop) > limit or any(not s for s in stop):
        raise BadRequest(f"{param}: at most {limit} non-empty strings", param)
    return tuple(stop)


def check_max_tokens(value: int | None, default: int | None, limit: int, param: str) -> int:
    if value is None:
        if default is None:
            raise BadRequest(f"{param}: required", param)
        value = default
    if value > limit:
        raise BadRequest(f"{param}: {value} is over the relay's limit of {limit}", param)
    return value
