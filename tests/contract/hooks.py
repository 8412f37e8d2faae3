"""schemathesis hooks for fanroute's apps (``SCHEMATHESIS_HOOKS=tests.contract.hooks``): what no JSON
Schema can say.

- ``application/x-ndjson`` (the gateway's episodes push) is sent as one JSON document per line, an
  array body being its lines;
- ``PUT /v1/blobs/{sha256}``: the body must hash to the path, so a positive case gets the hash of its body;
- the relay's ``/tr/{trace_id}/...``: a token opens one trace id only, so a positive case is sent to the
  episode whose token the run holds (:data:`tests.support.contract.RELAY_TRACE_ID`); any other trace id
  is a 403, which the document says;
- the publisher's operations on a model, a version, a file or a blob: a positive case names the seeded
  version (:func:`tests.support.contract.seed_publisher`), otherwise nearly every generated id names
  nothing and the run never gets past the 404;
- the console's trace, run and verdict ids: a positive case names the ones its store holds
  (:func:`tests.support.contract.console_app`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import schemathesis
from schemathesis.core.parameters import ParameterLocation

from tests.support.contract import (
    CONSOLE_RUN,
    CONSOLE_TRACE,
    RELAY_TRACE_ID,
    SEED_FILES,
    SEED_MODEL,
    SEED_VERSION,
    console_verdict_id,
    seed_sha256,
)

SEED_PATHS = {"model_id": SEED_MODEL, "version": SEED_VERSION, "name": next(iter(SEED_FILES))}


def _point_at_the_seed(case: schemathesis.Case) -> None:
    """A positive publisher case about a model, version, file or blob gets the seeded ones."""
    op = case.operation
    params = dict(case.path_parameters or {})
    for key, value in SEED_PATHS.items():
        if key in params:
            params[key] = value
    if "sha256" in params and op.method.upper() == "GET":
        params["sha256"] = seed_sha256()[SEED_PATHS["name"]]
    case.path_parameters = params
    if isinstance(case.body, dict):
        if op.path == "/v1/serving":
            case.body = {**case.body, "model_id": SEED_MODEL, "version": SEED_VERSION}
        elif op.path.endswith("/promote"):
            case.body = {**case.body, "version": SEED_VERSION}


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    lines = value if isinstance(value, list) else [value]
    return b"\n".join(json.dumps(v).encode() for v in lines)


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    op = case.operation
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    if not negative and op.path == "/traces/{trace_id}":
        case.path_parameters = {**(case.path_parameters or {}), "trace_id": CONSOLE_TRACE}
        return
    if not negative and op.path in ("/run", "/run/charts"):
        case.query = {**(case.query or {}), "id": CONSOLE_RUN}
        return
    if not negative and op.path == "/reviews" and isinstance(case.body, dict):
        case.body = {**case.body, "verdict_id": console_verdict_id()}
        return
    if op.path.startswith("/tr/{trace_id}/"):
        if not (negative and case.meta.is_negative_at(ParameterLocation.PATH)):  # a bad body gets to be read
            case.path_parameters = {**(case.path_parameters or {}), "trace_id": RELAY_TRACE_ID}
        return
    if not negative and (op.path.startswith("/v1/adapters/") or op.path == "/v1/serving"
                         or (op.method.upper(), op.path) == ("GET", "/v1/blobs/{sha256}")):
        _point_at_the_seed(case)
        return
    if negative or (op.method.upper(), op.path) != ("PUT", "/v1/blobs/{sha256}"):
        return
    body = case.body if isinstance(case.body, bytes) else getattr(case.body, "data", None)
    if isinstance(body, bytes):
        case.path_parameters["sha256"] = hashlib.sha256(body).hexdigest()
