"""Relay settings: where it listens, the sampler behind it, the policy's renderer, credentials, limits."""

from __future__ import annotations


from pydantic import Field, SecretStr, model_validator

from services.common import paths
from services.common.settings import ServiceSettings



class RelaySettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_SAMPLER_URL=http://sampler:8001`` or
    ``FANROUTE_HOUSEKEEPING_RULES='["^Generate a (short )?title"]'``."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255, description="Listen address")
    port: int = Field(default=8020, ge=0, le=65535, description="Listen port (0 = any free port)")
    sampler_url: str = Field(default="http://127.0.0.1:8001", pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
                             max_length=512,
                             description="Base URL of the sampler (CPU sampler or vLLM) whose /v1/completions "
                                         "the relay calls with token ids")
    sampler_timeout_s: float = Field(default=300.0, gt=0, le=3600, description="Timeout of one sampler call")
    stream_sampler: bool = Field(default=True,
                                 description="Ask the sampler to stream when the harness streams, and pass each "
                                             "piece on as it is decoded (false: sample the whole reply, then "
                                             "stream it)")
    tokenizer: str = Field(default_factory=lambda: str(paths.default_base_dir()), min_length=1,
                           description="Hugging Face directory of the policy's tokenizer (the sampler's base model); "
                                       "default: the embedded SmolLM2 in $FANROUTE_MODELS_DIR")
    renderer: str = Field(default="template", pattern=r"^[a-z0-9_-]{1,32}$",
                          description="The policy's renderer: 'template' (the tokenizer's chat template) or a "
                                      "model family of services.common.prompt.RENDERERS ('chatml')")
    base_model_name: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="The base model's id at the sampler (default: what the sampler's /v1/models lists first)")
    adapter_model_id: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9._-]{1,128}$",
        description="Sample with this adapter's newest version (its Redis stamp, read per call: "
                    "<model_id>@<stamp>); unset or stamp 0 = the base model")
    default_max_tokens: int = Field(default=256, ge=1, le=65_536,
                                    description="max_tokens of an OpenAI request that names none")
    max_tokens_limit: int = Field(default=4096, ge=1, le=65_536, description="Largest max_tokens a call may ask")
    max_stop_sequences: int = Field(default=16, ge=0, le=256, description="Most stop sequences per call")
    max_body_bytes: int = Field(default=8_000_000, ge=1024, le=100_000_000, description="Largest request body")
    housekeeping_header: str = Field(default="x-fanroute-housekeeping", pattern=r"^[a-z0-9-]{1,64}$",
                                     description="A call with this header set to 1/true/yes is housekeeping")
    housekeeping_rules: tuple[str, ...] = Field(
        default=(), max_length=64,
        description="Regular expressions (Python, searched case-insensitively) matched against the system "
                    "prompt and the last user message; a match marks the call housekeeping")
    credential_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 86_400,
                                    description="Lifetime of a minted one-episode credential")
    credential_tombstone_s: float = Field(
        default=3600.0, ge=0, le=7 * 86_400,
        description="How long after expiry a token is still known, so that it is refused as expired "
                    "(not unknown)")
    state_ttl_s: float = Field(default=6 * 3600.0, gt=0, le=30 * 86_400,
                               description="How long a trace's calls are kept in Redis for splicing and folding")
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token of the admin routes (minting and revoking credentials); "
                                  "unset = no admin routes (mint with `fanroute credentials mint` instead)")
    auth: bool = Field(default=True, description="Require a one-episode credential on /tr/<trace_id>/ (tests "
                                                  "and benchmarks may turn it off)")

    @model_validator(mode="after")
    def _default_within_limit(self) -> RelaySettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) is over max_tokens_limit "
                             f"({self.max_tokens_limit})")
        return self
