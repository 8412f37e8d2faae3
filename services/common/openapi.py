"""The HTTP contract every fanroute service keeps, in one place: the error body, its handlers, and an
OpenAPI document that says what the server really answers.

- :class:`ErrorBody` is ``{"error": <kind>, "reason": <text>}`` (a service may add fields, as the
  sampler adds vLLM's);
- :func:`errors` documents a route's own refusals with that body: ``responses=errors({404: "..."})``;
- :func:`install_contract` renders *every* refusal with it — invalid bodies and parameters, malformed
  JSON (400), unknown routes (404), wrong methods (405, with ``Allow``), unexpected failures (500) —
  and post-processes the OpenAPI document: FastAPI's ``HTTPValidationError`` answers become the error
  body under the status the service really uses, malformed JSON (400) and the body limit (413) are
  documented wherever a route takes a body;
- :data:`PROMETHEUS` and :func:`prometheus` are ``GET /metrics``: Prometheus' text format, documented
  as ``text/plain``.

Tested by schemathesis with all its checks against each app (``tests/contract``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from services.common.http import error

log = logging.getLogger(__name__)

#: Renders a refusal: (request, status, kind, reason, extra headers) → the response.
Render = Callable[[Request, int, str, str, Mapping[str, str] | None], Response]


class ErrorBody(BaseModel):
    """fanroute's error body: a machine-readable kind and a human-readable reason."""

    model_config = ConfigDict(extra="allow", title="ErrorBody")
    error: str = Field(min_length=1, description="What went wrong, as a stable kind (e.g. invalid_request)")
    reason: str = Field(min_length=1, description="Why, for a human: names the field, limit or resource")


ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
#: A string with a character that is not whitespace: what survives ``" ".join(text.split())`` (Python's
#: whitespace is JSON Schema's ``\s`` plus \x1c-\x1f), so the same in every regex dialect.
NON_BLANK = r"[^\s\x1c-\x1f]"
_JSON = "application/json"


def errors(descriptions: Mapping[int, str], model: type[BaseModel] = ErrorBody) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route's own refusals: each status with its description and :class:`ErrorBody`
    (or the service's extension of it, ``model``)."""
    return {status: {"model": model, "description": text} for status, text in descriptions.items()}


#: ``responses=`` of ``GET /metrics`` (use with ``response_class=Response``, answer with :func:`prometheus`).
PROMETHEUS: dict[int | str, dict[str, Any]] = {200: {
    "description": f"Prometheus text exposition format ({CONTENT_TYPE_LATEST})",
    "content": {"text/plain": {"schema": {"type": "string"}}}}}


def prometheus(registry: CollectorRegistry) -> Response:
    """The registry in Prometheus' text format."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def inline_schema(model: type[BaseModel], *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``model``'s JSON Schema with its ``$defs`` resolved in place (for ``openapi_extra``, whose
    schemas cannot add components); ``required`` adds fields the wire needs though the model defaults them."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    out = resolve(schema)
    if required:
        out["required"] = sorted(set(out.get("required", [])) | set(required))
    return out


def _default_render(request: Request, status: int, kind: str, reason: str,
                    headers: Mapping[str, str] | None) -> Response:
    response = error(status, kind, reason)
    if headers:
        response.headers.update(headers)
    return response


def _reason(errors_: list[dict[str, Any]], drop_first: bool) -> str:
    parts = []
    for e in errors_[:5]:
        loc = [str(p) for p in e.get("loc", ())][1 if drop_first else 0:]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


_HTTP_KINDS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
               415: "unsupported_media_type"}


def install_contract(app: FastAPI, *, validation_status: int = 422, render: Render = _default_render,
                     on_reject: Callable[[str], None] = lambda kind: None,
                     body_limit: Callable[[str], int] | None = None, loc_with_source: bool = False,
                     limits: Mapping[str, Mapping[str, Any]] | None = None,
                     patch: Callable[[dict[str, Any]], None] | None = None,
                     error_model: type[BaseModel] = ErrorBody) -> None:
    """Error handlers and an honest OpenAPI document for ``app`` (see the module doc).

    ``validation_status`` is what an invalid body or parameter gets (422; the sampler, like vLLM, 400);
    ``on_reject(kind)`` counts refusals; ``body_limit(path)`` (bytes, e.g. ``BodyLimit``'s) goes into
    the 413's description;
    ``loc_with_source`` keeps ``body.``/``path.`` in the reason's field names; ``limits`` puts limits
    that come from settings into the document (``{"SearchRequest.query": {"maxLength": 2048}}``).
    ``patch(doc)`` may change the finished document further. An error status a route documents without
    a body gets :class:`ErrorBody`, or ``error_model``: a service's extension of it (the relay's adds
    ``message``), which ``render`` then writes.
    """

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errs = list(exc.errors())
        bad_json = [e for e in errs if e.get("type") == "json_invalid"]
        if bad_json:
            e = bad_json[0]
            where = e.get("loc", ("body", "?"))[-1]
            detail = (e.get("ctx") or {}).get("error", e.get("msg", "JSON decode error"))
            on_reject("invalid_json")
            return render(request, 400, "invalid_json", f"body: not valid JSON ({detail} at character {where})", None)
        on_reject("invalid_request")
        return render(request, validation_status, "invalid_request", _reason(errs, not loc_with_source), None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        kind = _HTTP_KINDS.get(exc.status_code, f"http_{exc.status_code}")
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            kind, detail = "invalid_json", "body: not valid JSON (could not be decoded)"
        else:
            detail = f"{request.method} {request.url.path}: {exc.detail}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every route of this path, not only the first that matched it
            headers["Allow"] = ", ".join(_allowed(app, request))
        on_reject(kind)
        return render(request, exc.status_code, kind, detail, headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return render(request, 500, "internal", f"{type(exc).__name__}: the server failed on this request", None)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                              summary=app.summary, description=app.description, routes=app.routes,
                              tags=app.openapi_tags, servers=app.servers)
            doc = _honest(doc, validation_status, body_limit, limits or {}, error_model)
            if patch is not None:
                patch(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _allowed(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def _honest(doc: dict[str, Any], validation_status: int, body_limit: Callable[[str], int] | None,
            limits: Mapping[str, Mapping[str, Any]], error_model: type[BaseModel] = ErrorBody) -> dict[str, Any]:
    """FastAPI's document, with what the contract handlers really answer."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error_name = error_model.model_config.get("title") or error_model.__name__
    ref = {"$ref": f"#/components/schemas/{error_name}"}
    for where, constraints in limits.items():
        model, _, field = where.partition(".")
        schemas[model]["properties"][field].update(constraints)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.setdefault(error_name, error_model.model_json_schema(ref_template="#/components/schemas/{model}"))
    for path, path_item in doc.get("paths", {}).items():
        for method, op in path_item.items():
            if method not in ("get", "put", "post", "delete", "patch"):
                continue
            responses = op.setdefault("responses", {})
            default_422 = responses.get("422", {})
            if "HTTPValidationError" in str(default_422):
                del responses["422"]
                _add(responses, validation_status,
                     "Invalid request: the reason names each offending field and why", ref)
            for status, entry in responses.items():  # errors are JSON, whatever the route's own media type
                if status[0] in "45" and _JSON not in entry.get("content", {}):
                    entry["content"] = {_JSON: {"schema": ref}}
            body = op.get("requestBody")
            if body is None:
                continue
            if _JSON in body.get("content", {}):
                _add(responses, 400, "Malformed JSON: the body does not parse", ref)
            limit = f" ({body_limit(path)} bytes)" if body_limit else ""
            _add(responses, 413, f"Request body over this server's limit{limit}", ref)
    return doc


def _add(responses: dict[str, Any], status: int, description: str, ref: dict[str, str] = ERROR_REF) -> None:
    """Document ``status`` with the error body (a route's own description of it stays)."""
    entry = responses.setdefault(str(status), {"description": description})
    entry.setdefault("content", {}).setdefault(_JSON, {"schema": ref})
