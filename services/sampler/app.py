"""The sampler's HTTP surface: the subset of vLLM's OpenAI-compatible server that fanroute uses.

``GET /v1/models``, ``POST /v1/completions`` (text or token-id prompts; ``return_token_ids``,
``logprobs``; ``prompt_logprobs``, scored by :mod:`services.sampler.scoring`),
``POST /v1/chat/completions``, ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
answer in vLLM's shapes, so the relay, the router and the publisher work against either server.
Errors are ``{"error": <kind>, "reason": <text>}`` (fanroute's convention) plus the flat fields
of vLLM's error body (``object``, ``message``, ``type``, ``param``, ``code``).

The request and error bodies are in :mod:`services.sampler.wire`, the running sampler (engine,
adapters) in :mod:`services.sampler.serving`, and the response bodies in
:mod:`services.sampler.shaping`; this module holds the routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from services.common.adapter_files import ADAPTER_SHA256_HEADER
from services.common.http import BodyLimit, lifespan_of
from services.common.openapi import PROMETHEUS, errors, install_contract, prometheus
from services.sampler.registry import AdapterError
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from services.sampler.shaping import (
    create_chat_completion,
    create_completion,
    model_cards,
    plan_chat,
    plan_completion,
)
from services.sampler.streaming import chat_events, completion_events
from services.sampler.wire import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    error_response,
)

__all__ = ["Sampler", "create_app"]

_VLLM_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
_STREAMED: dict[int | str, dict[str, Any]] = {200: {
    "description": "The completion (vLLM's shape); with \"stream\": true, server-sent events: a chunk per "
                   "decoded piece, the usage chunk with stream_options.include_usage, then data: [DONE]",
    "content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "description": "One server-sent event",
        "properties": {"data": {"type": "string", "description": "A chunk as JSON, or [DONE] (the last event); a "
                                                                 "failure after the first byte is {\"error\": ...}"}}}}}}}
_GENERATE_ERRORS = {
    400: "Invalid or malformed request (vLLM's BadRequestError); also what depends on the model: a prompt "
         "over its context (prompt_too_long) or a token id outside its vocabulary",
    404: "No such model or adapter (model_not_found)",
    503: "The adapter's source (the publisher) is unreachable; retry (adapter_source_unreachable)"}


def create_app(settings: SamplerSettings, *, sampler: Sampler | None = None) -> FastAPI:
    """The FastAPI app; the model loads and the adapters consumer starts in the lifespan, before serving
    (with ``vllm_url`` set: the adapter loader of a vLLM server, :func:`vllm_loader_app`)."""
    if settings.vllm_url and sampler is None:
        return vllm_loader_app(settings)
    s = sampler or Sampler(settings)

    app = FastAPI(title="fanroute sampler", version="0.1.0", lifespan=lifespan_of(s),
                  description="vLLM-compatible completions with token ids, logprobs and runtime LoRA, on CPU.")
    app.state.sampler = s

    app.add_middleware(BodyLimit, default=settings.max_body_bytes,
                       on_reject=s.metrics.requests.labels("*", "413").inc,
                       render=lambda status, kind, reason: error_response(
                           ApiError(status, kind, reason, vllm_type=_VLLM_TYPES[413])))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        s.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(AdapterError)
    async def _adapter_error(request: Request, exc: AdapterError) -> JSONResponse:
        return await _api_error(request, ApiError(400, "invalid_adapter", str(exc), param="lora_path"))

    def render(request: Request, status: int, kind: str, reason: str, headers: Mapping[str, str] | None) -> Response:
        """Refusals from the framework (validation, malformed JSON, routing) in vLLM's error shape."""
        s.metrics.requests.labels(request.url.path, str(status)).inc()
        param = reason.split(":", 1)[0].split(".", 1)[0] if kind == "invalid_request" and ":" in reason else None
        response = error_response(ApiError(status, kind, reason, param=param if param != "body" else None,
                                           vllm_type=_VLLM_TYPES.get(status, "BadRequestError")))
        response.headers.update(headers or {})
        return response

    lim = settings.max_logprobs
    install_contract(app, validation_status=400, render=render, body_limit=lambda path: settings.max_body_bytes,
                     limits={"CompletionRequest.logprobs": {"maximum": lim},
                             "CompletionRequest.prompt_logprobs": {"minimum": 0, "maximum": lim},
                             "ChatCompletionRequest.top_logprobs": {"maximum": lim},
                             **{f"{m}.{f}": {"maximum": settings.max_tokens_limit} for m, f in (
                                 ("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                                 ("ChatCompletionRequest", "max_completion_tokens"))},
                             **{f"{m}.stop": {"maxItems": settings.max_stop_strings}
                                for m in ("CompletionRequest", "ChatCompletionRequest")}},
                     patch=lambda doc: _batch_limit(doc, settings.max_prompts))

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return model_cards(s)

    async def name_content(response: Response, model: str | None) -> None:
        """Say which adapter content answered (the header :data:`ADAPTER_SHA256_HEADER`; none for the base).
        The first answer of an adapter hashes its files in a thread, off the event loop; later ones reuse it."""
        entry = s.registry.resolve(model) if model else None
        if entry is not None:
            digest = entry.sha256 if entry.hashed else await asyncio.to_thread(lambda: entry.sha256)
            response.headers[ADAPTER_SHA256_HEADER] = digest

    def streamed(events: AsyncIterator[bytes], response: Response) -> StreamingResponse:
        """The events, with the headers already set on ``response`` (the adapter's content)."""
        headers = {"cache-control": "no-cache", **{k: v for k, v in response.headers.items()
                                                   if k == ADAPTER_SHA256_HEADER.lower()}}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions", responses={**errors(_GENERATE_ERRORS), **_STREAMED})
    async def completions(req: CompletionRequest, response: Response) -> Any:
        if req.stream:
            entry, plans = await plan_completion(s, req)
            await name_content(response, req.model)
            s.metrics.requests.labels("/v1/completions", "200").inc()
            return streamed(completion_events(
                s, entry, plans, model=req.model or s.model_name, logprobs=req.logprobs is not None,
                as_ids=bool(req.return_tokens_as_token_ids), token_ids=bool(req.return_token_ids),
                include_usage=bool(req.stream_options and req.stream_options.include_usage)), response)
        body = await create_completion(s, req)
        await name_content(response, req.model)
        s.metrics.requests.labels("/v1/completions", "200").inc()
        return body

    @app.post("/v1/chat/completions", responses={**errors(_GENERATE_ERRORS), **_STREAMED})
    async def chat_completions(req: ChatCompletionRequest, response: Response) -> Any:
        if req.stream:
            entry, plan, k = await plan_chat(s, req)
            await name_content(response, req.model)
            s.metrics.requests.labels("/v1/chat/completions", "200").inc()
            return streamed(chat_events(
                s, entry, plan, model=req.model or s.model_name, top_logprobs=k,
                as_ids=bool(req.return_tokens_as_token_ids), token_ids=bool(req.return_token_ids),
                include_usage=bool(req.stream_options and req.stream_options.include_usage)), response)
        body = await create_chat_completion(s, req)
        await name_content(response, req.model)
        s.metrics.requests.labels("/v1/chat/completions", "200").inc()
        return body

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors({
        400: "Invalid request, or the path is not a loadable PEFT adapter (invalid_adapter), or the name is "
             "taken (already_loaded) or the base model's"}))
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> str:
        return await s.load_lora(req)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses=errors({404: "No adapter or alias of that name (adapter_not_found)"}))
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> str:
        return await s.unload_lora(req)

    @app.get("/health", response_class=Response, responses={200: {"description": "Alive (empty body)"}})
    async def health() -> Response:
        """vLLM's liveness probe: 200, empty body."""
        return Response(status_code=200)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": s.model_name, "adapters": len(s.registry.entries()),
                "resident": s.registry.resident(), "aliases": s.registry.aliases(),
                "kafka": "off" if not settings.consume_adapters else
                "memory" if s.bus.in_memory else settings.kafka.bootstrap_servers}

    @app.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
    async def metrics() -> Response:
        return prometheus(s.metrics.registry)

    return app


def vllm_loader_app(settings: SamplerSettings) -> FastAPI:
    """The adapter loader of a vLLM server: no model here, only the adapters topic → vLLM, and its health."""
    from services.sampler.vllm_loader import VllmAdapters

    assert settings.vllm_url is not None
    loader = VllmAdapters(settings, settings.vllm_url)
    app = FastAPI(title="fanroute vLLM adapter loader", version="0.1.0", lifespan=lifespan_of(loader),
                  description="Loads every announced adapter version into the vLLM server at vllm_url.")
    app.state.loader = loader

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "vllm_url": loader.vllm_url, "resident": loader.registry.resident(),
                "adapters": len(loader.registry.entries()),
                "load_seconds_last": loader.load_seconds[-1] if loader.load_seconds else None}

    return app


def _batch_limit(doc: dict[str, Any], max_prompts: int) -> None:
    """A batch (a list of texts or of token-id lists) holds at most ``max_prompts`` prompts."""
    for variant in doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][2:]:
        variant["maxItems"] = max_prompts
