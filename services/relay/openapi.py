"""The relay's OpenAPI document: what each route takes and answers, as the app really does.

The routes read their bodies themselves (a credential is checked before the body is read), so the
request bodies are declared here (``openapi_extra``), from the wire models of :mod:`wire_openai` and
:mod:`wire_anthropic` with the refusals those models leave to code written into the schema (ranges,
``n`` = 1, no penalties, text-only content parts, the limits from the settings). The bodies stay open
(``additionalProperties``): the SDKs send fields the relay ignores. What depends on the policy's chat
template (tools, tool calls, tool results) or on how turns fit together is a documented 400.

Errors are :class:`RelayErrorBody`: the project's ``{"error", "reason"}`` plus ``message`` (and
``param``, the offending body field), flat on every route — the relay does not answer in OpenAI's
``{"error": {...}}`` or Anthropic's ``{"type": "error", ...}`` shapes, whose ``error`` is an object; the
SDKs raise their status errors from the status code and show the body.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.call import TRACE_ID_PATTERN
from services.common.openapi import ErrorBody, errors, inline_schema
from services.relay.credentials import TOKEN_PREFIX
from services.relay.settings import RelaySettings
from services.relay.wire_anthropic import MessagesBody
from services.relay.wire_openai import ChatCompletionBody

JSON, SSE = "application/json", "text/event-stream"


class RelayErrorBody(ErrorBody):
    """The relay's error body: fanroute's ``error`` and ``reason``, ``message`` (= ``reason``, where the
    SDKs look for a message) and, for a bad body, ``param``: the offending top-level field."""

    model_config = ConfigDict(extra="allow", title="RelayErrorBody")
    message: str = Field(min_length=1, description="The reason again, under the name both SDKs read")
    param: str | None = Field(default=None, min_length=1, description="The body field at fault, when one is")


def refusals(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` with :class:`RelayErrorBody`; a 401 documents its ``WWW-Authenticate`` header."""
    out = errors(descriptions, RelayErrorBody)
    if 401 in out:
        out[401]["headers"] = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
    return out


# ------------------------------------------------------------------------------------ requests
def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _stop_list(max_stop: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": max_stop}


def _number(low: float, high: float, *, exclusive_low: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": low} if exclusive_low else {"minimum": low}
    return _nullable({"type": "number", **bound, "maximum": high})


def chat_completion_schema(settings: RelaySettings) -> dict[str, Any]:
    """``POST /tr/{trace_id}/v1/chat/completions``' body (OpenAI's Chat Completions request)."""
    s = inline_schema(ChatCompletionBody)
    p = s["properties"]
    limit = settings.max_tokens_limit
    tokens = _nullable({"type": "integer", "minimum": 1, "maximum": limit})
    p["max_tokens"] = {**tokens, "description": f"Default {settings.default_max_tokens}; at most {limit}"}
    p["max_completion_tokens"] = {**tokens, "description": "Preferred over max_tokens when both are set"}
    p["temperature"], p["top_p"] = _number(0, 2), _number(0, 1, exclusive_low=True)
    p["n"] = {**_nullable({"type": "integer", "minimum": 1, "maximum": 1}),
              "description": "Only 1: each call is one sample of the policy"}
    p["stop"] = {"anyOf": [{"type": "string", "minLength": 1}, _stop_list(settings.max_stop_sequences),
                           {"type": "null"}], "default": None}
    p["response_format"] = _nullable({"type": "object", "additionalProperties": True, "properties": {
        "type": {"enum": ["text", None], "description": "Only 'text': the policy is sampled as it is"}}})
    for name in ("frequency_penalty", "presence_penalty"):
        p[name] = {"enum": [0, None], "default": None,
                   "description": "Only 0 or null: penalties would change what the policy samples"}
    p["top_logprobs"]["description"] = "Alternatives per sampled token; needs logprobs=true when over 0"
    part = p["messages"]["items"]["properties"]["content"]["anyOf"][1]["items"]
    part["properties"]["type"] = {"const": "text", "type": "string"}
    part["properties"]["text"] = {"type": "string"}
    part["required"] = ["type", "text"]
    message = p["messages"]["items"]
    message["allOf"] = [  # a tool turn names the call it answers; only an assistant turn has tool calls
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"properties": {"tool_call_id": {"type": "string", "minLength": 1}}, "required": ["tool_call_id"]}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}, "required": ["role"]},
         "then": {"properties": {"tool_calls": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}}}}]
    p["messages"]["description"] = (
        "The conversation. Tool turns need tool_call_id, tool_calls belong to assistant turns, and tool "
        "definitions, tool calls and tool results are rendered only by a chat template that reads them "
        "(else 400 unsupported_conversation)")
    s["if"] = {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]}
    s["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    return s


def messages_schema(settings: RelaySettings) -> dict[str, Any]:
    """``POST /tr/{trace_id}/v1/messages``' body (Anthropic's Messages request)."""
    s = inline_schema(MessagesBody)
    p = s["properties"]
    p["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": settings.max_tokens_limit}
    p["temperature"], p["top_p"] = _number(0, 1), _number(0, 1, exclusive_low=True)
    p["stop_sequences"] = _nullable(_stop_list(settings.max_stop_sequences))
    p["thinking"] = _nullable({"type": "object", "additionalProperties": True, "properties": {
        "type": {"enum": ["disabled", None], "description": "Extended thinking is not served"}}})
    block = p["messages"]["items"]["properties"]["content"]["anyOf"][1]["items"]
    block["properties"]["type"] = {"enum": ["text", "tool_use", "tool_result"], "type": "string",
                                   "description": "text (with text); tool_use (id, name, input) in assistant "
                                                  "turns; tool_result (tool_use_id, text content) in user turns"}
    text_block = {"type": "object", "additionalProperties": True, "required": ["type", "text"],
                  "properties": {"type": {"const": "text", "type": "string"}, "text": {"type": "string"}}}
    p["system"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_block}, {"type": "null"}],
                   "default": None}
    p["seed"]["description"] = "Not in Anthropic's API (an SDK sends it with extra_body): passed to the sampler"
    return s


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": True, "properties": properties, "required": list(required)}


#: ``POST /admin/v1/credentials``
MINT_BODY = _object({"trace_id": {"type": "string", "pattern": TRACE_ID_PATTERN,
                                  "description": "The episode the token opens"},
                     "ttl_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 7 * 86_400,
                               "description": "Lifetime in seconds (default: the relay's credential_ttl_s)"}},
                    ("trace_id",))
#: ``POST /admin/v1/credentials/revoke``
REVOKE_BODY = _object({"token": {"type": "string", "minLength": 1, "description": "The token to revoke"}},
                      ("token",))
#: ``POST /admin/v1/episodes/{trace_id}/end`` (optional: an empty body is advantage 0)
END_BODY = _object({"advantage": {"type": "number", "default": 0,
                                  "description": "Given to every sampled token of the episode's datums"}})


def body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body."""
    return {"requestBody": {"required": required, "content": {JSON: {"schema": schema}}}}


# ----------------------------------------------------------------------------------- responses
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Open):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class FunctionOut(_Open):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON string")


class ToolCallOut(_Open):
    id: str
    type: Literal["function"]
    function: FunctionOut


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class Logprobs(_Open):
    content: list[TokenLogprob]
    refusal: None = None


class Choice(_Open):
    index: int = Field(ge=0)
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: Logprobs | None = Field(description="With logprobs=true: each sampled token's logprob")


class ChatCompletion(_Open):
    """OpenAI's ``chat.completion``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[Choice] = Field(min_length=1, max_length=1)
    usage: Usage


class TextBlockOut(_Open):
    type: Literal["text"]
    text: str


class ToolUseOut(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(_Open):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class AnthropicMessage(_Open):
    """Anthropic's ``message``."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlockOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    type: Literal["model"]
    display_name: str
    created_at: str


class ModelList(_Open):
    """Both SDKs' model list in one body: OpenAI's ``object``/``data`` and Anthropic's paging fields."""

    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Minted(_Open):
    trace_id: str = Field(pattern=TRACE_ID_PATTERN)
    token: str = Field(pattern=f"^{TOKEN_PREFIX}[A-Za-z0-9_-]{{43}}$")
    ttl_s: float = Field(gt=0)
    base_path: str = Field(description="/tr/<trace_id>: the harness's base URL below the relay's")


class Revoked(_Open):
    revoked: Literal[True]


class EpisodeEnd(_Open):
    trace_id: str
    calls: int = Field(ge=1)
    dispositions: dict[str, int]
    segments: int = Field(ge=0)
    datums: list[dict[str, Any]] = Field(description="Tinker-shaped datums, one per segment")


class Health(_Open):
    status: Literal["ok"]
    renderer: str
    sampler: str
    kafka: str


class ChunkChoice(_Open):
    index: int = Field(ge=0)
    delta: dict[str, Any] = Field(description="role, then content deltas, then tool_calls; {} with the finish")
    logprobs: Logprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Open):
    """OpenAI's ``chat.completion.chunk``: one streamed event's data."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChunkChoice] = Field(max_length=1, description="Empty in the usage chunk")
    usage: Usage | None = Field(default=None, description="With stream_options.include_usage: null, then "
                                                          "the counts in the last chunk")


ANTHROPIC_EVENTS = ("message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "error")


def _json_data(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "string", "contentMediaType": JSON, "contentSchema": schema}


#: One event of OpenAI's stream (``schema`` of text/event-stream is per event before OpenAPI 3.2).
OPENAI_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"anyOf": [{"const": "[DONE]", "description": "The last event"},
                       _json_data(inline_schema(ChatCompletionChunk)),
                       _json_data({"type": "object", "required": ["error"], "description": "The call failed after "
                                   "its first byte (the sampler broke off): nothing is recorded; retry"})]}}}
#: One event of Anthropic's stream: its name, and data whose ``type`` is that name.
ANTHROPIC_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"enum": list(ANTHROPIC_EVENTS)},
    "data": _json_data({"type": "object", "required": ["type"], "additionalProperties": True, "properties": {
        "type": {"enum": list(ANTHROPIC_EVENTS)}, "index": {"type": "integer", "minimum": 0},
        "message": {"type": "object", "required": ["id", "type", "role", "model", "content"],
                    "description": "message_start: the message, no content and no stop reason yet"},
        "content_block": {"type": "object", "required": ["type"]}, "delta": {"type": "object"},
        "usage": {"type": "object"}}})}}


def generated(model: type[BaseModel], event: dict[str, Any], stream: str) -> dict[int | str, dict[str, Any]]:
    """A generate route's 200: the API's JSON body, or (``"stream": true``) its server-sent events."""
    return {200: {"model": model, "description": f"The reply; with \"stream\": true, {stream}",
                  "content": {SSE: {"schema": {**event, "description": "One server-sent event"}}}}}


CREDENTIAL = {401: "No usable credential: missing, malformed, unknown, expired or revoked (the error says "
                   "which: unauthenticated, malformed_credential, unknown_credential, expired_credential, "
                   "revoked_credential); checked before the body is read",
              403: "A live credential of another episode (forbidden)"}
TRACE_400 = "The trace id does not match its pattern (invalid_trace_id)"
SAMPLER = {502: "The sampler answered something the relay cannot use (sampler_unusable)",
           503: "The sampler did not answer, or answered with a 5xx (sampler_unavailable); retry"}
GENERATE = {400: f"{TRACE_400}; malformed JSON or not an object (invalid_json); an invalid body "
                 "(invalid_request, with param); a conversation the policy's renderer cannot render "
                 "(unsupported_conversation); or the sampler refused the call (sampler_refused: a prompt "
                 "over the model's context, ...)", **CREDENTIAL, **SAMPLER}
ADMIN = {401: "No 'Authorization: Bearer <admin token>' (unauthenticated)",
         403: "Not the admin token; an episode's token never opens the admin routes (forbidden)"}
ADMIN_OFF = "The admin routes are off: FANROUTE_ADMIN_TOKEN is not set (not_found)"


def patch(settings: RelaySettings) -> Callable[[dict[str, Any]], None]:
    """``install_contract``'s ``patch``: the trace id's pattern, the housekeeping header, the security
    schemes (an episode token on ``/tr/``, the admin token on ``/admin/``)."""
    housekeeping = {"name": settings.housekeeping_header, "in": "header", "required": False,
                    "description": "1, true, yes or on: a housekeeping call (served and recorded, never in a "
                                   "segment)", "schema": {"type": "string"}}

    def document(doc: dict[str, Any]) -> None:
        _document(doc, housekeeping)

    return document


def _document(doc: dict[str, Any], housekeeping: dict[str, Any]) -> None:
    doc.setdefault("components", {})["securitySchemes"] = {
        "episodeKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                       "description": "The episode's token as Anthropic's SDK sends it"},
        "episodeBearer": {"type": "http", "scheme": "bearer",
                          "description": "The episode's token as OpenAI's SDK sends it (x-api-key wins)"},
        "adminBearer": {"type": "http", "scheme": "bearer", "description": "FANROUTE_ADMIN_TOKEN"}}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if path.startswith("/tr/"):
                op["security"] = [{"episodeKey": []}, {"episodeBearer": []}]
            elif path.startswith("/admin/"):
                op["security"] = [{"adminBearer": []}]
            for param in op.get("parameters", ()):
                if param["name"] == "trace_id" and param["in"] == "path":
                    param["schema"] = {"type": "string", "pattern": TRACE_ID_PATTERN}
            if path.startswith("/tr/") and method == "post":
                op.setdefault("parameters", []).append(copy.deepcopy(housekeeping))
