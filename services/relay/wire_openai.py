"""OpenAI's Chat Completions wire format: the request as the official SDK sends it, the response and
the streamed ``chat.completion.chunk`` events (``data: {...}`` lines, then ``data: [DONE]``).

Fields that do not change what is sampled (``user``, ``metadata``, ``parallel_tool_calls``, ``store``,
...) are accepted and ignored; ones the relay cannot honour (``n`` > 1, images, JSON response formats,
penalties) are a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import json
import time
import uuid
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


class Part(Loose):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(Loose):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(Loose):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Part] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


class FunctionDef(Loose):
    name: StrictStr = Field(min_length=1, max_length=128)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(Loose):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Loose):
    include_usage: StrictBool | None = None


class ChatCompletionBody(Loose):
    """The fields of ``POST /v1/chat/completions`` the relay reads."""

    model: StrictStr = Field(min_length=1)
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise BadRequest(f"{where}[{i}]: content parts of type {part.type!r} are not served (text only)", where)
        out.append(part.text)
    return "".join(out)


def normalise(m: Message, i: int) -> dict[str, Any]:
    """One OpenAI message as a normalised chat-template dict."""
    where = f"messages[{i}]"
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": _text(m.content, f"{where}.content")}
    if m.tool_calls:
        if m.role != "assistant":
            raise BadRequest(f"{where}.tool_calls: only an assistant turn has tool calls", where)
        msg["tool_calls"] = [tool_call(c.id, c.function.name, c.function.arguments, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        if not m.tool_call_id:
            raise BadRequest(f"{where}.tool_call_id: a tool turn must name the call it answers", where)
        msg["tool_call_id"] = m.tool_call_id
    return msg


def parse(raw: dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int, max_stop: int) -> ChatRequest:
    """Validate and normalise a chat-completions body (pydantic errors are turned into 400s by the app)."""
    body = ChatCompletionBody.model_validate(raw)
    if body.n not in (None, 1):
        raise BadRequest("n: only n=1 is served (each call is one sample of the policy)", "n")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise BadRequest("response_format: only 'text' is served (the policy is sampled as it is)",
                         "response_format")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise BadRequest(f"{name}: penalties are not served (they would change what the policy samples)",
                             name)
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs: needs logprobs=true", "top_logprobs")
    tools = [] if body.tool_choice == "none" else [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools or ()]
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for name in ("max_tokens", "max_completion_tokens"):  # each within the limit, whichever is used
        check_max_tokens(getattr(body, name), 1, max_tokens_limit, name)
    sampling = Sampling(
        max_tokens=check_max_tokens(body.max_completion_tokens or body.max_tokens, default_max_tokens,
                                    max_tokens_limit, "max_tokens"),
        temperature=None if body.temperature is None else float(body.temperature),
        top_p=None if body.top_p is None else float(body.top_p), seed=body.seed,
        stop=check_stop(stop, max_stop, "stop"),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    return ChatRequest(wire="openai", model=body.model,
                       messages=[normalise(m, i) for i, m in enumerate(body.messages)], tools=tools,
                       sampling=sampling, stream=bool(body.stream),
                       include_usage=bool(body.stream_options and body.stream_options.include_usage), raw=raw)


# ------------------------------------------------------------------------------------ responses
def finish_reason(reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else reply.finish_reason


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in reply.tool_calls]


def _usage(reply: Reply) -> dict[str, int]:
    n = len(reply.sampled_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n, "total_tokens": reply.prompt_tokens + n}


def _logprobs(reply: Reply, token_texts: list[str]) -> dict[str, Any]:
    def entry(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}

    tops = reply.top_logprobs or [{} for _ in token_texts]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in top.items()]}
                        for t, lp, top in zip(token_texts, reply.logprobs, tops)], "refusal": None}


def completion(req: ChatRequest, reply: Reply, token_texts: list[str], call_id: str) -> dict[str, Any]:
    """The ``chat.completion`` body."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls
                               else None, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(reply),
                         "logprobs": _logprobs(reply, token_texts) if req.sampling.top_logprobs is not None
                         else None}],
            "usage": _usage(reply)}


class ChunkWriter:
    """OpenAI's streamed answer, a part at a time: :meth:`head` (the role chunk), :meth:`text` per delta
    (as the sampler decodes it, or cut from the whole reply), :meth:`tail` (tool calls, the finish chunk
    with the logprobs, the usage chunk when ``stream_options.include_usage``, ``[DONE]``)."""

    def __init__(self, req: ChatRequest, call_id: str) -> None:
        self.req = req
        self.base = {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": req.model, "system_fingerprint": None}

    def _event(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        body = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.req.include_usage:
            body["usage"] = None
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def head(self) -> bytes:
        return self._event({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        return self._event({"content": delta})

    def tail(self, reply: Reply, token_texts: list[str]) -> Iterator[bytes]:
        for i, c in enumerate(_tool_calls(reply)):
            yield self._event({"tool_calls": [{"index": i, **c}]})
        lp = _logprobs(reply, token_texts) if self.req.sampling.top_logprobs is not None else None
        yield self._event({}, finish_reason(reply), lp)
        if self.req.include_usage:
            yield b"data: " + json.dumps({**self.base, "choices": [], "usage": _usage(reply)}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    @staticmethod
    def error(kind: str, reason: str) -> bytes:
        """A failure after the first byte (the status is sent): the error object OpenAI's SDK raises on."""
        return b"data: " + json.dumps({"error": {"message": reason, "type": kind, "param": None,
                                                 "code": kind}}).encode() + b"\n\n"


def chunks(req: ChatRequest, reply: Reply, deltas: list[str], token_texts: list[str], call_id: str) -> Iterator[bytes]:
    """The streamed answer of a whole reply: a role chunk, one chunk per text delta, then the tail."""
    w = ChunkWriter(req, call_id)
    yield w.head()
    for d in deltas:
        yield w.text(d)
    yield from w.tail(reply, token_texts)


def models(model_ids: list[str]) -> dict[str, Any]:
    now = int(time.time())
    return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "fanroute"}
                                       for m in model_ids]}


def new_call_suffix() -> str:
    return uuid.uuid4().hex[:24]
