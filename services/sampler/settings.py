"""Sampler settings: the base model, adapter residency and cache, limits, and where adapters come from."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from schemas.adapter import MODEL_ID_PATTERN, ROUTER_MODEL_ID
from services.common import paths
from services.common.settings import ServiceSettings



class SamplerSettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_BASE_MODEL=/models/x`` or ``FANROUTE_MAX_RESIDENT_ADAPTERS=2``."""

    host: str = Field(default="127.0.0.1", description="Listen address")
    port: int = Field(default=8001, ge=0, le=65535, description="Listen port (0 = any free port)")
    base_model: str = Field(default_factory=lambda: str(paths.default_base_dir()), min_length=1,
                            description="Hugging Face directory (or hub id, where weights are cached) of the base LM; "
                                        "default: the embedded SmolLM2 in $FANROUTE_MODELS_DIR (see "
                                        "services.common.paths; `fanroute models prepare` makes it)")
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256,
                                          description="Model id of the base in the API; default: base_model as given")
    dtype: str = Field(default="float32", pattern=r"^(float32|bfloat16|float16)$", description="Weights dtype")
    threads: int | None = Field(default=None, ge=1, le=256, description="torch CPU threads (default: torch's)")
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576,
                                      description="Prompt + completion token limit (default: the model's context)")
    max_tokens_limit: int = Field(default=1024, ge=1, le=65_536, description="Largest max_tokens one request may ask")
    default_max_tokens: int = Field(default=16, ge=1, le=65_536,
                                    description="max_tokens of a completion that names none (vLLM/OpenAI: 16)")
    max_logprobs: int = Field(default=20, ge=0, le=1000, description="Most alternatives per token (vLLM: 20)")
    max_stop_strings: int = Field(default=16, ge=0, le=256, description="Most stop strings per request")
    max_prompts: int = Field(default=8, ge=1, le=256, description="Most prompts in one batched completion")
    max_num_seqs: int = Field(
        default=16, ge=1, le=1024,
        description="Most generations decoded together, one token each per forward (vLLM: --max-num-seqs); "
                    "1 decodes one request at a time")
    score_max_batch: int = Field(
        default=32, ge=1, le=1024,
        description="Most concurrent prompt_logprobs requests (one adapter) scored together in one forward")
    score_batch_wait_ms: float = Field(
        default=2.0, ge=0, le=1000,
        description="How long a scoring batch waits for more requests before its forward (ms); it waits "
                    "again while the last wait brought one or fewer are queued than the adapter's last forward "
                    "answered, up to score_batch_max_wait_ms")
    score_batch_max_wait_ms: float = Field(
        default=10.0, ge=0, le=1000,
        description="Longest a scoring batch waits in all for more requests (ms; at least score_batch_wait_ms)")
    score_max_forward_tokens: int = Field(default=4096, ge=16, le=1_048_576,
                                          description="Most new prompt tokens in one scoring forward")
    score_row_tokens: int = Field(default=192, ge=8, le=65_536,
                                  description="Tokens per packed row of a scoring forward (shorter rows, "
                                              "cheaper attention; longer, less padding)")
    prefix_cache_entries: int = Field(default=8, ge=0, le=4096,
                                      description="Token prefixes whose keys/values scoring keeps (0 = off)")
    prefix_cache_min_tokens: int = Field(default=16, ge=1, le=1_048_576,
                                         description="Shortest prefix worth keeping in the prefix cache")
    merged_models: tuple[Annotated[str, Field(pattern=MODEL_ID_PATTERN)], ...] = Field(
        default=(ROUTER_MODEL_ID,), max_length=64,
        description="Model ids whose adapter versions are also scored through a merged copy (the LoRA folded "
                    "into the weights, bf16 weights packed for oneDNN once): a router decision then pays no "
                    "LoRA matmuls; generation still goes through peft (services.sampler.merged)")
    merged_copies: int = Field(default=2, ge=0, le=16,
                               description="Merged copies held at once, newest kept (a promotion's old and new "
                                           "version); each is a copy of the model's weights; 0 = none")
    fused_layers: bool = Field(default=True,
                               description="In a bf16 merged copy of a Llama model, run each decoder layer as "
                                           "four oneDNN matmuls with its norm, rotary, SiLU, gate and residual "
                                           "work fused in (services.sampler.fused); false: the plain layers")
    merged_dtype: Literal["same", "auto", "float32", "bfloat16"] = Field(
        default="same",
        description="Weights dtype of the merged scoring copies: same = the engine's (dtype); auto = bfloat16 on "
                    "a CPU with AMX (where bf16 matmuls pay), else the engine's; generation keeps the engine's "
                    "dtype, so the relay's token logprobs do not change")
    merged_build_attempts: int = Field(default=3, ge=0, le=16,
                                       description="Tries at building a merged copy outside the engine's lock "
                                                   "(an adapter load racing one makes it build again; then it is "
                                                   "built under the lock); 0 = always under the lock, which stops "
                                                   "scoring for the build (seconds under load)")
    max_body_bytes: int = Field(default=4_000_000, ge=1024, le=100_000_000, description="Largest request body")
    max_resident_adapters: int = Field(default=4, ge=1, le=256,
                                       description="LoRA adapters held in memory at once (vLLM: --max-loras)")
    max_lora_rank: int = Field(default=64, ge=1, le=1024,
                               description="Largest LoRA rank accepted (vLLM: --max-lora-rank)")
    adapter_cache_dir: Path = Field(default_factory=paths.adapter_cache_dir,
                                    description="Where pulled adapter versions are kept (<model_id>/<version>/); "
                                                "default <cache>/sampler/adapters (see services.common.paths)")
    publisher_url: str | None = Field(
        default=None, min_length=1,
        description="Publisher base URL (e.g. http://publisher:8010): pull through its client, and fetch "
                    "versions never announced here (router@7) on demand; unset = plain HTTP from message URLs")
    fetch_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Timeout of one adapter download")
    consume_adapters: bool = Field(default=True, description="Follow the adapters topic (pull and load new versions)")
    group_id: str | None = Field(default=None, min_length=1, max_length=128,
                                 description="Consumer group on the adapters topic; default one per host, "
                                             "since every replica must see every adapter")
    vllm_url: str | None = Field(
        default=None, min_length=1, max_length=2048, pattern=r"^https?://\S+$",
        description="A vLLM server (e.g. http://vllm:8002) to keep the adapters of: this process then loads no "
                    "model and serves no completions; it follows the adapters topic and loads each version "
                    "into vLLM (services.sampler.vllm_loader). vLLM must see adapter_cache_dir")
    accept_base_models: tuple[str, ...] = Field(
        default=(), description="AdapterPublished.base_model values to load; empty = every announcement")

    @property
    def score_batch_max_wait_s(self) -> float:
        """The batcher's cap on waiting, in seconds: never below ``score_batch_wait_ms``."""
        return max(self.score_batch_max_wait_ms, self.score_batch_wait_ms) / 1000

    @property
    def consumer_group(self) -> str:
        """``group_id``, or ``fanroute-sampler.<hostname>`` so that each replica loads every version."""
        return self.group_id or f"fanroute-sampler.{socket.gethostname()}"

    @property
    def model_name(self) -> str:
        """The base model's id in /v1/models and in requests."""
        return self.served_model_name or self.base_model
