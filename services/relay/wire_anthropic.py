"""Anthropic's Messages wire format: the request as the official SDK sends it, the ``message`` response
and the streamed events (``event: <name>`` + ``data: {...}``: ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``).

``system`` (a string or text blocks) becomes the system turn; ``tool_use`` blocks become tool calls and
``tool_result`` blocks tool turns, as a chat template expects. Images, documents and extended thinking
are a 400 naming the field. ``seed`` (not in Anthropic's API; an SDK sends it with ``extra_body``) is
passed to the sampler.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from services.relay.conversation import (
    BadRequest,
    ChatRequest,
    Loose,
    Reply,
    Sampling,
    check_max_tokens,
    check_stop,
    tool_call,
)


class Block(Loose):
    type: StrictStr
    text: StrictStr | None = None
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: Any = None
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None


class Message(Loose):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class ToolDef(Loose):
    name: StrictStr = Field(min_length=1, max_length=128)
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class MessagesBody(Loose):
    """The fields of ``POST /v1/messages`` the relay reads."""

    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[Block] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=1)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    tools: list[ToolDef] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _texts(blocks: list[Block], where: str) -> str:
    out = []
    for i, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise BadRequest(f"{where}[{i}]: blocks of type {b.type!r} are not served here", where)
        out.append(b.text)
    return "".join(out)


def _tool_result_text(b: Block, where: str) -> str:
    if b.content is None or isinstance(b.content, str):
        return b.content or ""
    parts = []
    for i, c in enumerate(b.content):
        if c.get("type") != "text" or not isinstance(c.get("text"), str):
            raise BadRequest(f"{where}.content[{i}]: tool results are served as text only", where)
        parts.append(c["text"])
    return "".join(parts)


def normalise(m: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as normalised chat-template dicts (tool results become ``tool`` turns)."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    text, calls = [], []
    for j, b in enumerate(m.content):
        at = f"{where}[{j}]"
        if b.type == "text" and b.text is not None:
            text.append(b.text)
        elif b.type == "tool_use" and m.role == "assistant" and b.id and b.name:
            calls.append(tool_call(b.id, b.name, b.input if b.input is not None else {}, at))
        elif b.type == "tool_result" and m.role == "user" and b.tool_use_id:
            out.append({"role": "tool", "content": _tool_result_text(b, at), "tool_call_id": b.tool_use_id})
        else:
            raise BadRequest(f"{at}: a {b.type!r} block in a {m.role} turn is not served (text, tool_use in "
                             "assistant turns, tool_result in user turns)", where)
    if text or calls or not out:
        msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def parse(raw: dict[str, Any], *, max_tokens_limit: int, max_stop: int) -> ChatRequest:
    body = MessagesBody.model_validate(raw)
    if body.thinking and body.thinking.get("type") not in (None, "disabled"):
        raise BadRequest("thinking: extended thinking is not served (the policy is sampled as it is)", "thinking")
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _texts(body.system, "system")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        messages += normalise(m, i)
    choice = (body.tool_choice or {}).get("type")
    tools = [] if choice == "none" else [
        {"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description else {}),
                                          "parameters": t.input_schema}} for t in body.tools or ()]
    sampling = Sampling(
        max_tokens=check_max_tokens(body.max_tokens, None, max_tokens_limit, "max_tokens"),
        temperature=None if body.temperature is None else float(body.temperature),
        top_p=None if body.top_p is None else float(body.top_p), top_k=body.top_k, seed=body.seed,
        stop=check_stop(list(body.stop_sequences or []), max_stop, "stop_sequences"))
    return ChatRequest(wire="anthropic", model=body.model, messages=messages, tools=tools, sampling=sampling,
                       stream=bool(body.stream), raw=raw)


# ------------------------------------------------------------------------------------ responses
def stop_fields(req: ChatRequest, reply: Reply) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if reply.tool_calls:
        return "tool_use", None
    if reply.finish_reason == "length":
        return "max_tokens", None
    if isinstance(reply.stop_reason, str) and reply.stop_reason in req.sampling.stop:
        return "stop_sequence", reply.stop_reason
    return "end_turn", None


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text or not reply.tool_calls else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
               for c in reply.tool_calls]
    return blocks


def message(req: ChatRequest, reply: Reply, call_id: str) -> dict[str, Any]:
    """The ``message`` body."""
    stop_reason, stop_sequence = stop_fields(req, reply)
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": req.model,
            "content": _blocks(reply), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": len(reply.sampled_ids)}}


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


class EventWriter:
    """Anthropic's streamed answer, a part at a time: :meth:`head` (``message_start``), :meth:`text` per
    delta (the text block opens with the first), :meth:`tail` (the text block closed, or an empty one
    when there is neither text nor a tool call; the tool-use blocks; ``message_delta``; ``message_stop``)."""

    def __init__(self, req: ChatRequest, call_id: str) -> None:
        self.req, self.call_id, self.open = req, call_id, False

    def head(self, prompt_tokens: int) -> bytes:
        start = {"id": f"msg_{self.call_id}", "type": "message", "role": "assistant", "model": self.req.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": prompt_tokens, "output_tokens": 1}}
        return _sse("message_start", {"type": "message_start", "message": start})

    def _open(self) -> Iterator[bytes]:
        if not self.open:
            self.open = True
            yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
            yield _sse("ping", {"type": "ping"})

    def text(self, delta: str) -> Iterator[bytes]:
        yield from self._open()
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": delta}})

    def tail(self, reply: Reply) -> Iterator[bytes]:
        stop_reason, stop_sequence = stop_fields(self.req, reply)
        index = 0
        if self.open or not reply.tool_calls:
            yield from self._open()
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        for i, c in enumerate(reply.tool_calls, start=index):
            yield _sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                "type": "tool_use", "id": c["id"], "name": c["name"], "input": {}}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(c["arguments"])}})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": i})
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                     "usage": {"output_tokens": len(reply.sampled_ids)}})
        yield _sse("message_stop", {"type": "message_stop"})

    @staticmethod
    def error(kind: str, reason: str) -> bytes:
        """A failure after the first byte: Anthropic's ``error`` event (its SDK raises on it)."""
        anthropic_type = "overloaded_error" if kind == "sampler_unavailable" else "api_error"
        return _sse("error", {"type": "error", "error": {"type": anthropic_type, "message": reason}})


def events(req: ChatRequest, reply: Reply, deltas: list[str], call_id: str) -> Iterator[bytes]:
    """The streamed answer of a whole reply, in Anthropic's event order."""
    w = EventWriter(req, call_id)
    yield w.head(reply.prompt_tokens)
    for d in deltas:
        yield from w.text(d)
    yield from w.tail(reply)


def models(model_ids: list[str]) -> dict[str, Any]:
    """Anthropic's model list (``GET /v1/models``)."""
    data = [{"type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z"} for m in model_ids]
    return {"data": data, "has_more": False, "first_id": model_ids[0] if model_ids else None,
            "last_id": model_ids[-1] if model_ids else None}
