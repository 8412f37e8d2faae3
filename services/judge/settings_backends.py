"""Configs of the judge backends that call an LLM over HTTP (OpenAI-compatible and Anthropic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

_HTTP_URL = r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s/?#@]+(?:[/?#]|$)"


def _base_url(description: str, **default: Any) -> Any:
    """The ``base_url`` field: an http(s) URL with a host, described per API."""
    return Field(**default, min_length=8, max_length=2048, pattern=_HTTP_URL,
                 description=f"{description}; part of the judge's identity")


class _HttpJudgeConfig(BaseModel):
    """What every HTTP judge needs: where, which model, which key, and how hard to try."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = _base_url("API base URL (http or https)")
    model: str = Field(min_length=1, max_length=256, description="Model name sent with every call")
    api_key: SecretStr | None = Field(default=None, description="API key (never logged)")
    timeout_s: float = Field(default=60.0, gt=0, le=600,
                             description="Timeout of one HTTP attempt, connect to last byte")
    max_attempts: int = Field(default=4, ge=1, le=10,
                              description="Attempts per judgement, counting retries after 429/5xx/"
                                          "timeouts/connect errors and unreadable replies")
    backoff_s: float = Field(default=1.0, ge=0, le=60,
                             description="Wait before the first retry, doubled for each further one "
                                         "(a Retry-After header takes precedence)")
    max_tokens: int = Field(default=400, ge=16, le=32_768, description="Most tokens the model may answer")


class OpenAIJudgeConfig(_HttpJudgeConfig):
    """An OpenAI-compatible chat completions API: OpenAI itself, vLLM, llama.cpp server, ..."""

    type: Literal["openai"] = Field(default="openai", description="Backend kind")
    base_url: str = _base_url("Base URL up to and including the API version, e.g. "
                              "http://host:8000/v1 (vLLM) or https://api.openai.com/v1")


class AnthropicJudgeConfig(_HttpJudgeConfig):
    """Anthropic's Messages API; ``api_key`` is required (checked when the backend starts)."""

    type: Literal["anthropic"] = Field(default="anthropic", description="Backend kind")
    base_url: str = _base_url("Base URL without the /v1 path", default="https://api.anthropic.com")
