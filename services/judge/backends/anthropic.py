"""A judge behind Anthropic's Messages API.

``POST {base_url}/v1/messages`` with ``x-api-key`` and ``anthropic-version: 2023-06-01``; the
system prompt is the top-level ``system`` field and the answer is the text of the ``content``
blocks of type ``text``. Errors are ``{"type": "error", "error": {"type", "message"}}``; 429
(``rate_limit_error``) and 529 (``overloaded_error``) are retried like any 5xx.
"""

from __future__ import annotations

from typing import Any

from services.judge.backends.http import BadReply, LlmReply, _HttpJudge, text_field
from services.judge.base import JudgeRequest
from services.judge.rubric import SYSTEM, render_user
from services.judge.settings_backends import AnthropicJudgeConfig

API_VERSION = "2023-06-01"


class AnthropicJudge(_HttpJudge):
    """Messages API at temperature 0; needs an API key."""

    config: AnthropicJudgeConfig
    kind = "anthropic"
    path = "/v1/messages"
    needs_key = True

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"x-api-key": key or "", "anthropic-version": API_VERSION}

    def _body(self, request: JudgeRequest, retry: int) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "max_tokens": self.config.max_tokens,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": render_user(request)}],
            "temperature": 0,
        }

    def _reply(self, body: dict[str, Any]) -> LlmReply:
        if body.get("type") == "error":
            raise BadReply(self._error_reason(body) or "error body with a 2xx status")
        blocks = body.get("content")
        if not isinstance(blocks, list):
            raise BadReply("no content blocks in the message")
        text = "".join(b["text"] for b in blocks
                       if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
        stop = body.get("stop_reason")
        if stop == "refusal":
            raise BadReply("model refused (stop_reason=refusal)")
        if not text.strip():
            raise BadReply(f"no text content blocks (stop_reason={stop})")
        return LlmReply(text, truncated="stop_reason=max_tokens" if stop == "max_tokens" else None)

    def _error_reason(self, body: Any) -> str | None:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return None
        kind, message = text_field(error.get("type")), text_field(error.get("message"))
        return f"{kind}: {message}" if kind and message else kind or message or None
