"""The relay's HTTP surface: OpenAI's and Anthropic's APIs under ``/tr/<trace_id>/``, and admin routes.

- ``POST /tr/{trace_id}/v1/chat/completions`` (OpenAI), ``POST /tr/{trace_id}/v1/messages`` (Anthropic),
  ``GET /tr/{trace_id}/v1/models`` (either SDK's model list), streaming or not;
- ``POST /admin/v1/credentials`` ``{"trace_id", "ttl_s"?}`` → a one-episode token;
  ``POST /admin/v1/credentials/revoke`` ``{"token"}``; ``POST /admin/v1/episodes/{trace_id}/end`` → the
  episode's calls folded into segments and datums. Admin routes need ``FANROUTE_ADMIN_TOKEN`` (as a
  Bearer token) and do not exist without it; an episode token never opens them;
- ``GET /healthz``.

A harness's credential is checked before its body is read; a refusal (401/403) never reaches the
sampler. User agents are never looked at. Every error, the framework's (404, 405, 413, 500) included, is
``{"error": <kind>, "reason": <text>}`` plus ``message`` (and ``param``): :mod:`services.relay.openapi`,
which also holds the OpenAPI document's request bodies, answers and security schemes.
"""

from __future__ import annotations

import hmac
import logging
import json
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from schemas.call import TRACE_ID_PATTERN
from services.common.datums import DatumError
from services.common.http import BodyLimit, lifespan_of
from services.common.openapi import install_contract
from services.relay import openapi as doc
from services.relay import wire_anthropic, wire_openai
from services.relay.conversation import BadRequest
from services.relay.credentials import token_of
from services.relay.render import RenderRefused
from services.relay.sampling import SamplerUnavailable
from services.relay.service import Outcome, Relay, Started
from services.relay.settings import RelaySettings

_TRACE = re.compile(TRACE_ID_PATTERN)


def refuse(status: int, kind: str, reason: str, param: str | None = None) -> JSONResponse:
    """fanroute's error body, plus ``message`` (and ``param``) as the SDKs read them."""
    body: dict[str, Any] = {"error": kind, "reason": reason, "message": reason}
    if param:
        body["param"] = param
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


_NO_ROUTE = ("(the relay serves /tr/<trace_id>/v1/chat/completions, /tr/<trace_id>/v1/messages and "
             "/tr/<trace_id>/v1/models)")


def _framework_refusal(request: Request, status: int, kind: str, reason: str, headers: Mapping[str, str] | None) -> JSONResponse:
    """The framework's refusals (unknown route, wrong method, crash) in the relay's error body."""
    if status == 404:
        reason = f"no route {request.method} {request.url.path} {_NO_ROUTE}"
    response = refuse(status, kind, reason)
    response.headers.update(headers or {})
    return response


def _validation_reason(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    reason = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
    first = errors[0]["loc"][:1] if errors else ()
    return reason, str(first[0]) if first else None


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body: not valid JSON ({exc})", kind="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    return body


async def _passed_on(wire: str, req: Any, started: Started, items: AsyncIterator[Started | str | Outcome]
                     ) -> AsyncIterator[bytes]:
    """A streamed call's events as the sampler decodes it; a failure after the first byte is the wire's
    error event (no ``Call`` is recorded for it: the harness retries the call)."""
    suffix = started.call_id.replace(":", "_")
    w: Any = (wire_openai.ChunkWriter(req, suffix) if wire == "openai" else wire_anthropic.EventWriter(req, suffix))
    yield w.head() if wire == "openai" else w.head(started.prompt_tokens)
    try:
        async for item in items:
            if isinstance(item, str):
                if wire == "openai":
                    yield w.text(item)
                else:
                    for event in w.text(item):
                        yield event
            elif isinstance(item, Outcome):
                for event in (w.tail(item.reply, item.token_texts) if wire == "openai" else w.tail(item.reply)):
                    yield event
    except Exception as exc:  # noqa: BLE001 - the status is sent: the stream says it, and nothing is recorded
        kind = getattr(exc, "kind", "internal_error")
        logging.getLogger(__name__).warning("a streamed call failed after its first byte (%s): %s", kind, exc)
        yield w.error(kind, str(exc))
    finally:
        await items.aclose()


def create_app(settings: RelaySettings, *, relay: Relay | None = None) -> FastAPI:
    r = relay or Relay(settings)
    app = FastAPI(title="fanroute relay", version="0.1.0", lifespan=lifespan_of(r),
                  description="OpenAI and Anthropic APIs in, token ids to the sampler, every call recorded.")
    app.state.relay = r
    app.add_middleware(BodyLimit, default=settings.max_body_bytes,
                       render=lambda status, kind, reason: refuse(status, kind, reason))
    install_contract(app, validation_status=400, render=_framework_refusal, body_limit=lambda path: settings.max_body_bytes,
                     error_model=doc.RelayErrorBody, patch=doc.patch(settings))
    admin_token = settings.admin_token.get_secret_value() if settings.admin_token else ""

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return refuse(exc.status, exc.kind, exc.reason, exc.param)

    @app.exception_handler(RenderRefused)
    async def _render(request: Request, exc: RenderRefused) -> JSONResponse:
        return refuse(400, "unsupported_conversation", str(exc), "messages")

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> JSONResponse:
        reason, param = _validation_reason(exc)
        return refuse(400, "invalid_request", reason, param)

    @app.exception_handler(SamplerUnavailable)
    async def _sampler(request: Request, exc: SamplerUnavailable) -> JSONResponse:
        return refuse(exc.status, exc.kind, str(exc))

    async def episode(request: Request, trace_id: str) -> JSONResponse | None:
        """None when the request may use ``trace_id``; else the refusal."""
        if not _TRACE.match(trace_id):
            return refuse(400, "invalid_trace_id", f"trace id {trace_id[:200]!r} does not match {TRACE_ID_PATTERN}")
        if not settings.auth:
            return None
        token = token_of(request.headers.get("authorization"), request.headers.get("x-api-key"))
        refusal = await r.credentials.check(token, trace_id)
        return None if refusal is None else refuse(refusal.status, refusal.kind, refusal.reason)

    async def serve(request: Request, trace_id: str, wire: str) -> Any:
        if (refusal := await episode(request, trace_id)) is not None:
            return refusal
        raw = await _json_object(request)
        if wire == "openai":
            req = wire_openai.parse(raw, default_max_tokens=settings.default_max_tokens,
                                    max_tokens_limit=settings.max_tokens_limit, max_stop=settings.max_stop_sequences)
        else:
            req = wire_anthropic.parse(raw, max_tokens_limit=settings.max_tokens_limit,
                                       max_stop=settings.max_stop_sequences)
        if req.stream and settings.stream_sampler:
            items = r.stream_call(trace_id, req, request.headers)
            started = await anext(items)  # the sampler has answered: a refusal raised here is a plain 4xx/5xx
            assert isinstance(started, Started)
            return StreamingResponse(_passed_on(wire, req, started, items), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        out = await r.call(trace_id, req, request.headers)
        suffix = out.call.call_id.replace(":", "_")
        if not req.stream:
            body = (wire_openai.completion(req, out.reply, out.token_texts, suffix) if wire == "openai"
                    else wire_anthropic.message(req, out.reply, suffix))
            return JSONResponse(body)
        events = (wire_openai.chunks(req, out.reply, out.deltas, out.token_texts, suffix) if wire == "openai"
                  else wire_anthropic.events(req, out.reply, out.deltas, suffix))
        return StreamingResponse(iter(list(events)), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @app.post("/tr/{trace_id}/v1/chat/completions", openapi_extra=doc.body(doc.chat_completion_schema(settings)),
              responses={**doc.generated(doc.ChatCompletion, doc.OPENAI_EVENT, "OpenAI's chat.completion.chunk events, then "
                                                             "data: [DONE]"), **doc.refusals(doc.GENERATE)})
    async def chat_completions(request: Request, trace_id: str) -> Any:
        """OpenAI's Chat Completions: the episode's conversation, sampled by the policy, recorded."""
        return await serve(request, trace_id, "openai")

    @app.post("/tr/{trace_id}/v1/messages", openapi_extra=doc.body(doc.messages_schema(settings)),
              responses={**doc.generated(doc.AnthropicMessage, doc.ANTHROPIC_EVENT, "Anthropic's message_start ... message_stop "
                                                               "events"), **doc.refusals(doc.GENERATE)})
    async def messages(request: Request, trace_id: str) -> Any:
        """Anthropic's Messages: the episode's conversation, sampled by the policy, recorded."""
        return await serve(request, trace_id, "anthropic")

    @app.get("/tr/{trace_id}/v1/models", responses={200: {"model": doc.ModelList},
                                                    **doc.refusals({400: doc.TRACE_400, **doc.CREDENTIAL,
                                                                    **doc.SAMPLER})})
    async def models(request: Request, trace_id: str) -> Any:
        """The policy's model, in a list both SDKs read."""
        if (refusal := await episode(request, trace_id)) is not None:
            return refusal
        name, _ = await r.policy()
        a, o = wire_anthropic.models([name]), wire_openai.models([name])
        return {**a, "object": "list", "data": [{**x, **y} for x, y in zip(a["data"], o["data"])]}

    # ------------------------------------------------------------------------------ admin
    def admin_refusal(request: Request) -> JSONResponse | None:
        if not admin_token:
            return refuse(404, "not_found", "the admin routes are off (set FANROUTE_ADMIN_TOKEN, or mint with "
                          "`fanroute credentials mint`)")
        scheme, _, value = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not value:
            return refuse(401, "unauthenticated", "the admin routes need 'Authorization: Bearer <admin token>'")
        if not hmac.compare_digest(value.strip().encode(), admin_token.encode()):
            return refuse(403, "forbidden", "not the admin token (an episode's token opens only its episode)")
        return None

    @app.post("/admin/v1/credentials", status_code=201, openapi_extra=doc.body(doc.MINT_BODY),
              responses={201: {"model": doc.Minted, "description": "A one-episode token"},
                         **doc.refusals({400: "Malformed JSON (invalid_json), or an invalid trace_id or ttl_s "
                                              "(invalid_request)", **doc.ADMIN, 404: doc.ADMIN_OFF})})
    async def mint(request: Request) -> Any:
        """Mint a token that opens ``/tr/<trace_id>/`` for ``ttl_s`` seconds."""
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        body = await _json_object(request)
        trace_id, ttl = body.get("trace_id"), body.get("ttl_s", settings.credential_ttl_s)
        if not isinstance(trace_id, str) or not _TRACE.match(trace_id):
            raise BadRequest(f"trace_id: a string matching {TRACE_ID_PATTERN}", "trace_id")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= 7 * 86_400:
            raise BadRequest("ttl_s: seconds, more than 0 and at most 604800", "ttl_s")
        token = await r.credentials.mint(trace_id, float(ttl), settings.credential_tombstone_s)
        return JSONResponse({"trace_id": trace_id, "token": token, "ttl_s": ttl,
                             "base_path": f"/tr/{trace_id}"}, status_code=201)

    @app.post("/admin/v1/credentials/revoke", openapi_extra=doc.body(doc.REVOKE_BODY),
              responses={200: {"model": doc.Revoked},
                         **doc.refusals({400: "Malformed JSON (invalid_json), or no token (invalid_request)",
                                         **doc.ADMIN, 404: f"{doc.ADMIN_OFF}; or no such credential, never "
                                                           "minted or long expired (unknown_credential)"})})
    async def revoke(request: Request) -> Any:
        """Revoke a token: refused as revoked from now on."""
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        token = (await _json_object(request)).get("token")
        if not isinstance(token, str) or not token:
            raise BadRequest("token: the token to revoke", "token")
        if not await r.credentials.revoke(token, settings.credential_tombstone_s):
            return refuse(404, "unknown_credential", "no such credential (never minted, or long expired)")
        return {"revoked": True}

    @app.post("/admin/v1/episodes/{trace_id}/end", openapi_extra=doc.body(doc.END_BODY, required=False),
              responses={200: {"model": doc.EpisodeEnd},
                         **doc.refusals({400: "Malformed JSON (invalid_json), an invalid trace id or advantage "
                                              "(invalid_request)", **doc.ADMIN,
                                         404: f"{doc.ADMIN_OFF}; or no calls recorded for this trace id, or "
                                              "they expired (unknown_episode)",
                                         409: "The calls do not fold into datums (unfoldable_episode)"})})
    async def end(request: Request, trace_id: str) -> Any:
        """Fold the episode's calls into segments and Tinker-shaped datums."""
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        if not _TRACE.match(trace_id):
            raise BadRequest(f"trace id does not match {TRACE_ID_PATTERN}", "trace_id")
        raw = await request.body()
        body = await _json_object(request) if raw.strip() else {}
        advantage = body.get("advantage", 0.0)
        if isinstance(advantage, bool) or not isinstance(advantage, int | float) or not math.isfinite(advantage):
            raise BadRequest("advantage: a finite number (given to every sampled token)", "advantage")
        calls = await r.state.calls(trace_id)
        if not calls:
            return refuse(404, "unknown_episode", "no calls recorded for this trace id (or they expired)")
        try:
            return await r.end(trace_id, calls, float(advantage))
        except DatumError as exc:
            return refuse(409, "unfoldable_episode", str(exc))

    @app.get("/healthz", response_model=doc.Health)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "renderer": r.renderer.name, "sampler": settings.sampler_url,
                "kafka": "memory" if r.bus.in_memory else settings.kafka.bootstrap_servers}

    return app
