"""The sampler's wire formats: vLLM's OpenAI-compatible request bodies and its error body.

Request models accept what vLLM accepts for the fields fanroute uses (strictly typed, unknown
fields ignored); :class:`ApiError` is a request we refuse, and :func:`error_response` renders it
as fanroute's ``{"error", "reason"}`` plus the flat fields of vLLM's error body.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from services.common.errors import FanrouteError
from services.common.openapi import NON_BLANK


class ApiError(FanrouteError):
    """A request we refuse: HTTP status, fanroute error kind, vLLM error type and the offending field."""

    def __init__(self, status: int, kind: str, reason: str, *, vllm_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.kind, self.reason, self.vllm_type, self.param = status, kind, reason, vllm_type, param


def bad_request(reason: str, param: str | None = None, kind: str = "invalid_request") -> ApiError:
    return ApiError(400, kind, reason, param=param)


def error_response(exc: ApiError) -> JSONResponse:
    """fanroute's ``{"error", "reason"}`` plus the flat fields of vLLM's error body."""
    return JSONResponse({"error": exc.kind, "reason": exc.reason, "object": "error", "message": exc.reason,
                         "type": exc.vllm_type, "param": exc.param, "code": exc.status}, status_code=exc.status)


# ------------------------------------------------------------------------------ request bodies
Stop = StrictStr | list[StrictStr] | None
TokenIds = list[StrictInt]

# What the server refuses with 400 besides the model's own checks, in the OpenAPI document (the
# refusals keep vLLM's messages, so the models do not enforce these themselves). Limits that come from
# the settings are filled in by ``services.sampler.app``.
_ONLY_FALSE = {"anyOf": [{"type": "boolean", "const": False}, {"type": "null"}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, _IDS,
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                           {"type": "array", "items": _IDS, "minItems": 1}]}
STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}


class StreamOptions(BaseModel):
    """vLLM's ``stream_options``: a last chunk with the token counts."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool | None = False


class SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = Field(default=None, description="Base model id or an adapter's model id")
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2,
                                                        description="0 = greedy; default 1.0")
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Stop = Field(default=None, json_schema_extra=STOP_SCHEMA)
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    n: StrictInt = Field(default=1, ge=1, le=1, description="Only n=1 is served")
    stream: StrictBool | None = Field(default=False, description="Server-sent events, a chunk per decoded "
                                      "piece, then data: [DONE] (not with prompt_logprobs)")
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them; ``prompt_logprobs``
    scores the prompt tokens too (vLLM's ``CompletionRequest.prompt_logprobs``)."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds] = Field(
        json_schema_extra=PROMPT_SCHEMA, description="Text or token ids, or a batch of either (not empty)")
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0)
    prompt_logprobs: StrictInt | None = Field(
        default=None, description="vLLM's extra parameter: every prompt token's logprob, rank and this many "
                                  "alternatives (0 = the actual token only); checked against max_logprobs")
    echo: StrictBool | None = Field(default=False, description="Echoing the prompt is not served",
                                    json_schema_extra=_ONLY_FALSE)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: StrictStr = Field(json_schema_extra={"pattern": NON_BLANK})
    lora_path: StrictStr = Field(json_schema_extra={"pattern": NON_BLANK},
                                 description="A PEFT adapter directory on the sampler's machine")
    load_inplace: StrictBool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None
