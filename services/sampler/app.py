"""The sampler's HTTP surface: the subset of vLLM's OpenAI-compatible server that fanroute uses.

``GET /v1/models``, ``POST /v1/completions`` (text or token-id prompts; ``return_token_ids``,
``logprobs``), ``POST /v1/chat/completions``, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` answer in vLLM's shapes, so the relay and the publisher work
against either server. Errors are ``{"error": <kind>, "reason": <text>}`` (fanroute's convention)
plus the flat fields of vLLM's error body (``object``, ``message``, ``type``, ``param``, ``code``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.adapter import parse_versioned
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import FanrouteError
from services.common.http import BodyLimit, lifespan_of
from services.sampler.engine import Engine, Generation, PromptError, SamplingParams
from services.sampler.registry import (
    AdapterEntry,
    AdapterError,
    AdapterRegistry,
    AdapterUnavailable,
    check_adapter_dir,
)
from services.sampler.settings import SamplerSettings
from services.sampler.worker import (
    AdapterStore,
    AdapterWorker,
    Fetcher,
    default_fetcher,
)

log = logging.getLogger(__name__)
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this so the JSON stays valid


class ApiError(FanrouteError):
    """A request we refuse: HTTP status, fanroute error kind, vLLM error type and the offending field."""

    def __init__(self, status: int, kind: str, reason: str, *, vllm_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.kind, self.reason, self.vllm_type, self.param = status, kind, reason, vllm_type, param


def bad_request(reason: str, param: str | None = None, kind: str = "invalid_request") -> ApiError:
    return ApiError(400, kind, reason, param=param)


# ------------------------------------------------------------------------------ request bodies
Stop = StrictStr | list[StrictStr] | None
TokenIds = list[StrictInt]


class _Sampling(BaseModel):
    """Sampling fields shared by completions and chat (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = Field(default=None, description="Base model id or an adapter's model id")
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2,
                                                        description="0 = greedy; default 1.0")
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Stop = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    n: StrictInt = Field(default=1, ge=1, le=1, description="Only n=1 is served")
    stream: StrictBool | None = Field(default=False, description="Streaming is not served")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool | None = Field(default=False, description="Echoing the prompt is not served")


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


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


# ------------------------------------------------------------------------------ the sampler
class SamplerMetrics:
    """Requests, tokens, generation time and adapter churn."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fanroute_sampler_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.tokens = Counter("fanroute_sampler_tokens", "Tokens processed", ["kind"], registry=self.registry)
        self.generation_seconds = Histogram("fanroute_sampler_generation_seconds", "Time of one generation",
                                            registry=self.registry)
        self.adapter_events = Counter("fanroute_sampler_adapter_events", "Adapter loads, evictions, refusals",
                                      ["event"], registry=self.registry)
        self.resident = Gauge("fanroute_sampler_adapters_resident", "Adapters in memory", registry=self.registry)


class Sampler:
    """Engine + adapter registry + the adapters-topic worker of one running sampler."""

    def __init__(self, settings: SamplerSettings, *, engine: Engine | None = None, bus: Bus | None = None,
                 fetcher: Fetcher | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.bus = bus or Bus(settings.kafka, client_id="fanroute-sampler")
        self.registry = AdapterRegistry(settings.max_resident_adapters)
        store = AdapterStore(settings.adapter_cache_dir,
                             fetcher or default_fetcher(settings.publisher_url, settings.fetch_timeout_s))
        self.worker = AdapterWorker(self, store, publisher_url=settings.publisher_url,
                                    accept_base_models=settings.accept_base_models)
        self.metrics = SamplerMetrics()
        self._slots = 0

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    async def start(self) -> None:
        """Load the base model (once), restore cached adapters, then follow the adapters topic."""
        if self.engine is None:
            s = self.settings
            self.engine = await asyncio.to_thread(Engine, s.base_model, dtype=s.dtype,
                                                  max_model_len=s.max_model_len, threads=s.threads)
        restored = self.worker.restore()
        if restored:
            log.info("restored %d verified adapter versions from %s", restored, self.settings.adapter_cache_dir)
        if self.settings.consume_adapters:
            self.bus.subscribe(topic("adapters"), self.worker.handle, group_id=self.settings.consumer_group)
            await self.bus.start((topic("adapters"),))

    async def stop(self) -> None:
        if self.settings.consume_adapters:
            await self.bus.stop()

    # -------------------------------------------------------------------- adapters
    async def register(self, entry: AdapterEntry, *, replace: bool = False) -> None:
        """Check ``entry``'s dir, then add it and make it resident; nothing is kept if either step fails."""
        cfg = check_adapter_dir(entry.path, max_rank=self.settings.max_lora_rank)
        entry.rank = cfg["r"]
        await asyncio.to_thread(self._register_locked, entry, replace)

    def _register_locked(self, entry: AdapterEntry, replace: bool) -> None:
        with self.eng.lock:
            old = self.registry.get(entry.name)
            if old is not None and replace:
                self._evict(old)  # the new entry takes its name (and keeps the aliases to it)
            self.registry.add(entry)
            try:
                self._resident_slot(entry)
            except Exception:
                self.registry.remove(entry.name)
                self.metrics.adapter_events.labels("refused").inc()
                raise

    def _resident_slot(self, entry: AdapterEntry) -> str:
        """``entry``'s slot, loading it (and evicting the least recently used) if needed; hold the lock."""
        if self.registry.get(entry.name) is not entry:
            raise AdapterUnavailable(f"The model `{entry.name}` was unloaded")
        if not self.registry.is_resident(entry.name) or entry.slot is None:
            for name in self.registry.to_evict_for(entry.name):
                victim = self.registry.get(name)
                if victim is not None:
                    self._evict(victim)
                self.registry.mark_evicted(name)
            self._slots += 1
            slot = f"lora{self._slots}"
            self.eng.load_adapter(slot, entry.path)
            entry.slot = slot
            self.metrics.adapter_events.labels("loaded").inc()
        self.registry.mark_resident(entry.name)
        self.metrics.resident.set(len(self.registry.resident()))
        return entry.slot

    def _evict(self, entry: AdapterEntry) -> None:
        if entry.slot is not None:
            self.eng.unload_adapter(entry.slot)
            entry.slot = None
            self.metrics.adapter_events.labels("evicted").inc()
        self.registry.mark_evicted(entry.name)
        self.metrics.resident.set(len(self.registry.resident()))

    async def load_lora(self, req: LoadLoRAAdapterRequest) -> str:
        """vLLM's load_lora_adapter: validate, load (pre-loading it), and answer its success text."""
        name, path = req.lora_name.strip(), req.lora_path.strip()
        if not name or not path:
            raise ApiError(400, "invalid_request", "Both 'lora_name' and 'lora_path' must be provided.",
                           vllm_type="InvalidUserInput")
        if name == self.model_name:
            raise ApiError(400, "invalid_request", f"'{name}' is the base model's name",
                           vllm_type="InvalidUserInput", param="lora_name")
        if self.registry.get(name) is not None and not req.load_inplace:
            raise ApiError(400, "already_loaded", f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.",
                           vllm_type="InvalidUserInput", param="lora_name")
        parsed = parse_versioned(name)
        entry = AdapterEntry(name, Path(path).expanduser(), model_id=parsed[0] if parsed else None,
                             version=parsed[1] if parsed else None)
        await self.register(entry, replace=req.load_inplace)
        if parsed and parsed[1] >= (self.registry.newest_version(parsed[0]) or 0) \
                and self.registry.get(parsed[0]) is None:
            self.registry.point_alias(parsed[0], name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora(self, req: UnloadLoRAAdapterRequest) -> str:
        """vLLM's unload_lora_adapter: an adapter name frees it; an alias name drops the alias only."""
        name = req.lora_name
        entry = self.registry.get(name)
        if entry is None:
            if not self.registry.drop_alias(name):
                raise ApiError(404, "adapter_not_found", f"The lora adapter '{name}' cannot be found.",
                               vllm_type="NotFoundError", param="lora_name")
        else:
            await asyncio.to_thread(self._unload_locked, entry)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _unload_locked(self, entry: AdapterEntry) -> None:
        with self.eng.lock:
            self._evict(entry)
            self.registry.remove(entry.name)

    async def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter ``model`` names (None = the base), fetched on demand if it is unknown here."""
        if model is None or model == self.model_name:
            return None
        try:
            return await self.worker.ensure(model)
        except AdapterUnavailable as exc:
            self.metrics.adapter_events.labels("unavailable").inc()
            raise ApiError(404, "model_not_found", str(exc), vllm_type="NotFoundError", param="model") from exc
        except AdapterError as exc:
            raise ApiError(404, "model_not_found", f"The model `{model}` could not be loaded: {exc}",
                           vllm_type="NotFoundError", param="model") from exc

    # -------------------------------------------------------------------- generation
    @property
    def eng(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the sampler has not started: no engine")
        return self.engine

    async def generate(self, entry: AdapterEntry | None, prompt_ids: list[int],
                       params: SamplingParams) -> Generation:
        """One generation, serialized with every other use of the model."""
        gen = await asyncio.to_thread(self._generate_locked, entry, prompt_ids, params)
        self.metrics.tokens.labels("prompt").inc(len(prompt_ids))
        self.metrics.tokens.labels("completion").inc(len(gen.token_ids))
        self.metrics.generation_seconds.observe(gen.seconds)
        return gen

    def _generate_locked(self, entry: AdapterEntry | None, prompt_ids: list[int],
                         params: SamplingParams) -> Generation:
        with self.eng.lock:
            slot = self._resident_slot(entry) if entry is not None else None
            return self.eng.generate(prompt_ids, params, slot=slot)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """Validate token ids and length; returns the max_tokens to use (vLLM's context-length rules)."""
        if not prompt_ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        vocab = self.eng.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is out of vocabulary [0, {vocab})", param)
        limit, n = self.eng.max_model_len, len(prompt_ids)
        if n >= limit:
            raise ApiError(400, "prompt_too_long", f"This model's maximum context length is {limit} tokens. "
                           f"However, your prompt has {n} tokens. Please reduce the length of the prompt.",
                           param=param)
        if max_tokens is None:
            return min(self.settings.max_tokens_limit, limit - n)
        if max_tokens > self.settings.max_tokens_limit:
            raise bad_request(f"max_tokens: {max_tokens} is over this server's limit of "
                              f"{self.settings.max_tokens_limit}", "max_tokens")
        if n + max_tokens > limit:
            raise ApiError(400, "prompt_too_long", f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} "
                           "in the completion). Please reduce the length of the messages or completion.",
                           param="max_tokens")
        return max_tokens


# ------------------------------------------------------------------------------ request → engine
def sampling_params(req: _Sampling, settings: SamplerSettings, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """vLLM's defaults for what the request leaves out; refuses what this server does not serve."""
    if req.stream:
        raise bad_request("stream: streaming is not served by the CPU sampler", "stream")
    if logprobs is not None and logprobs > settings.max_logprobs:
        raise bad_request(f"logprobs: {logprobs} is over the limit of {settings.max_logprobs}", "logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > settings.max_stop_strings or any(not s for s in stop):
        raise bad_request(f"stop: at most {settings.max_stop_strings} non-empty strings", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=req.top_k or 0, seed=req.seed, stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)


def _token_name(engine: Engine, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else engine.token_text(token_id)


def completion_logprobs(engine: Engine, gen: Generation, as_ids: bool) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs``: tokens, token_logprobs, top_logprobs (sampled + top-k), text_offset."""
    tokens = [_token_name(engine, t, as_ids) for t in gen.token_ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"text_offset": offsets,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in gen.logprobs],
            "tokens": tokens,
            "top_logprobs": [{_token_name(engine, i, as_ids): max(lp, LOGPROB_FLOOR) for i, lp in step}
                             for step in gen.top_logprobs]}


def chat_logprobs(engine: Engine, gen: Generation, k: int, as_ids: bool) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs``: one entry per sampled token with ``k`` alternatives."""

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        name = _token_name(engine, token_id, as_ids)
        return {"token": name, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(name.encode("utf-8", "replace"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in step[:k]]}
                        for t, lp, step in zip(gen.token_ids, gen.logprobs, gen.top_logprobs)]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompts(req: CompletionRequest, engine: Engine, max_prompts: int) -> list[list[int]]:
    """The request's prompts as token-id lists (text is tokenized like vLLM does)."""
    p = req.prompt
    if isinstance(p, str):
        batch: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        batch = [p]  # type: ignore[list-item]
    else:
        batch = list(p)  # type: ignore[arg-type]
    if not batch:
        raise bad_request("prompt: must not be empty", "prompt")
    if len(batch) > max_prompts:
        raise bad_request(f"prompt: {len(batch)} prompts; at most {max_prompts} per request", "prompt")
    out = []
    for item in batch:
        if isinstance(item, str) and not item:
            raise bad_request("prompt: must not be empty", "prompt")
        out.append(engine.encode(item) if isinstance(item, str) else list(item))
    return out


async def create_completion(s: Sampler, req: CompletionRequest) -> dict[str, Any]:
    """``/v1/completions`` → vLLM's ``CompletionResponse`` (one choice per prompt)."""
    if req.echo:
        raise bad_request("echo: echoing the prompt is not served by the CPU sampler", "echo")
    entry = await s.resolve(req.model)
    prompts = _prompts(req, s.eng, s.settings.max_prompts)
    max_tokens = req.max_tokens if req.max_tokens is not None else s.settings.default_max_tokens
    plans = [(ids, s.check_prompt(ids, max_tokens, "prompt")) for ids in prompts]
    choices, n_prompt, n_completion = [], 0, 0
    for index, (ids, mt) in enumerate(plans):
        gen = await s.generate(entry, ids, sampling_params(req, s.settings, mt, req.logprobs))
        choices.append({
            "index": index, "text": gen.text,
            "logprobs": completion_logprobs(s.eng, gen, bool(req.return_tokens_as_token_ids))
            if req.logprobs is not None else None,
            "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason,
            "token_ids": gen.token_ids if req.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": gen.prompt_token_ids if req.return_token_ids else None})
        n_prompt, n_completion = n_prompt + len(ids), n_completion + len(gen.token_ids)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or s.model_name, "choices": choices, "usage": _usage(n_prompt, n_completion)}


async def create_chat_completion(s: Sampler, req: ChatCompletionRequest) -> dict[str, Any]:
    """``/v1/chat/completions`` → vLLM's ``ChatCompletionResponse``."""
    entry = await s.resolve(req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = s.eng.chat_prompt(messages)
    except PromptError as exc:
        raise bad_request(str(exc), "messages") from exc
    except Exception as exc:  # a template may raise on roles or orders it does not support
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from exc
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = s.check_prompt(ids, req.max_completion_tokens or req.max_tokens, "messages")
    gen = await s.generate(entry, ids, sampling_params(req, s.settings, max_tokens, k))
    choice = {"index": 0, "message": {"role": "assistant", "content": gen.text},
              "logprobs": chat_logprobs(s.eng, gen, k, bool(req.return_tokens_as_token_ids)) if k is not None
              else None,
              "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason,
              "token_ids": gen.token_ids if req.return_token_ids else None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or s.model_name, "choices": [choice],
            "usage": _usage(len(ids), len(gen.token_ids)),
            "prompt_logprobs": None, "prompt_token_ids": ids if req.return_token_ids else None}


def model_cards(s: Sampler) -> dict[str, Any]:
    """vLLM's ``ModelList``: the base, then every adapter (``parent`` = the base), then the aliases."""
    now = int(time.time())

    def card(model_id: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": now, "owned_by": "fanroute", "root": root,
                "parent": parent, "max_model_len": max_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}

    data = [card(s.model_name, s.settings.base_model, None, s.eng.max_model_len)]
    data += [card(e.name, str(e.path), s.model_name, None) for e in s.registry.entries()]
    for alias, target in s.registry.aliases().items():
        if s.registry.get(alias) is None and (e := s.registry.get(target)) is not None:
            data.append(card(alias, str(e.path), s.model_name, None))
    return {"object": "list", "data": data}


# ------------------------------------------------------------------------------ the app
def create_app(settings: SamplerSettings, *, sampler: Sampler | None = None) -> FastAPI:
    """The FastAPI app; the model loads and the adapters consumer starts in the lifespan, before serving."""
    s = sampler or Sampler(settings)

    app = FastAPI(title="fanroute sampler", version="0.1.0", lifespan=lifespan_of(s),
                  description="vLLM-compatible completions with token ids, logprobs and runtime LoRA, on CPU.")
    app.state.sampler = s

    app.add_middleware(BodyLimit, default=settings.max_body_bytes,
                       on_reject=s.metrics.requests.labels("*", "413").inc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        s.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc)

    @app.exception_handler(AdapterError)
    async def _adapter_error(request: Request, exc: AdapterError) -> JSONResponse:
        return await _api_error(request, ApiError(400, "invalid_adapter", str(exc), param="lora_path"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0]["loc"][1:2] if errors else ()
        reason = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors[:5])
        return await _api_error(request, bad_request(reason, str(first[0]) if first else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(ApiError(exc.status_code, kind, str(exc.detail), vllm_type="NotFoundError"
                               if exc.status_code == 404 else "BadRequestError"))

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return model_cards(s)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        body = await create_completion(s, req)
        s.metrics.requests.labels("/v1/completions", "200").inc()
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> dict[str, Any]:
        body = await create_chat_completion(s, req)
        s.metrics.requests.labels("/v1/chat/completions", "200").inc()
        return body

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> str:
        return await s.load_lora(req)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> str:
        return await s.unload_lora(req)

    @app.get("/health")
    async def health() -> Response:
        """vLLM's liveness probe: 200, empty body."""
        return Response(status_code=200)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": s.model_name, "adapters": len(s.registry.entries()),
                "resident": s.registry.resident(), "aliases": s.registry.aliases(),
                "kafka": "off" if not settings.consume_adapters else
                "memory" if s.bus.in_memory else settings.kafka.bootstrap_servers}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _error(exc: ApiError) -> JSONResponse:
    """fanroute's ``{"error", "reason"}`` plus the flat fields of vLLM's error body."""
    return JSONResponse({"error": exc.kind, "reason": exc.reason, "object": "error", "message": exc.reason,
                         "type": exc.vllm_type, "param": exc.param, "code": exc.status}, status_code=exc.status)
