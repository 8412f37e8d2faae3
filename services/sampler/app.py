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

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.http import BodyLimit, lifespan_of
from services.sampler.registry import AdapterError
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from services.sampler.shaping import create_chat_completion, create_completion, model_cards
from services.sampler.wire import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    error_response,
)

__all__ = ["Sampler", "create_app"]


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
        return error_response(exc)

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
        return error_response(ApiError(exc.status_code, kind, str(exc.detail), vllm_type="NotFoundError"
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
