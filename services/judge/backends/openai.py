"""A judge behind an OpenAI-compatible chat completions API (OpenAI, vLLM, llama.cpp server, ...).

``POST {base_url}/chat/completions`` with ``Authorization: Bearer`` when a key is set; the answer
is ``choices[0].message.content``. Errors are ``{"error": {"message", "type", "param", "code"}}``;
older vLLM servers put those fields at the top level with ``"object": "error"``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from services.judge.backends.http import BadReply, LlmReply, _HttpJudge, text_field
from services.judge.base import JudgeRequest
from services.judge.rubric import SYSTEM, render_user
from services.judge.settings_backends import OpenAIJudgeConfig


class OpenAIJudge(_HttpJudge):
    """Chat completions at temperature 0 with a seed derived from the trace and attempt."""

    config: OpenAIJudgeConfig
    kind = "openai"
    path = "/chat/completions"

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _body(self, request: JudgeRequest, retry: int) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": render_user(request)}],
            "temperature": 0,
            "max_tokens": self.config.max_tokens,
            "seed": seed_for(request.trace_id, request.attempt, retry),
        }

    def _reply(self, body: dict[str, Any]) -> LlmReply:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise BadReply("no choices[0] in the completion")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise BadReply("choices[0] has no message")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            refusal = text_field(message.get("refusal"))
            raise BadReply(f"model refused: {refusal}" if refusal else
                           f"choices[0].message.content is empty "
                           f"(finish_reason={choice.get('finish_reason')})")
        cut = "finish_reason=length" if choice.get("finish_reason") == "length" else None
        return LlmReply(content, truncated=cut)

    def _error_reason(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return None
        error = body.get("error")
        if isinstance(error, str):
            return error
        fields = error if isinstance(error, dict) else body if body.get("object") == "error" else None
        if fields is None:
            return None
        kind = ", ".join(str(fields[k]) for k in ("type", "code") if fields.get(k) not in (None, ""))
        message = text_field(fields.get("message"))
        return f"{kind}: {message}" if kind and message else kind or message or None


def seed_for(trace_id: str, attempt: int, retry: int) -> int:
    """A stable 31-bit seed per (trace, judge attempt, HTTP retry); retry 0 depends on the first two."""
    key = f"{trace_id}/{attempt}" + (f"/{retry}" if retry else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFF_FFFF
