"""schemathesis hooks for fanroute's apps (``SCHEMATHESIS_HOOKS=tests.contract.hooks``): what no JSON
Schema can say.

- ``application/x-ndjson`` (the gateway's episodes push) is sent as one JSON document per line, an
  array body being its lines;
- ``PUT /v1/blobs/{sha256}``: the body must hash to the path, so a positive case gets the hash of its body;
- the relay's ``/tr/{trace_id}/...``: a token opens one trace id only, so a positive case is sent to the
  episode whose token the run holds (:data:`tests.support.contract.RELAY_TRACE_ID`); any other trace id
  is a 403, which the document says.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import schemathesis
from schemathesis.core.parameters import ParameterLocation

from tests.support.contract import RELAY_TRACE_ID


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    lines = value if isinstance(value, list) else [value]
    return b"\n".join(json.dumps(v).encode() for v in lines)


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    op = case.operation
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    if op.path.startswith("/tr/{trace_id}/"):
        if not (negative and case.meta.is_negative_at(ParameterLocation.PATH)):  # a bad body gets to be read
            case.path_parameters = {**(case.path_parameters or {}), "trace_id": RELAY_TRACE_ID}
        return
    if negative or (op.method.upper(), op.path) != ("PUT", "/v1/blobs/{sha256}"):
        return
    body = case.body if isinstance(case.body, bytes) else getattr(case.body, "data", None)
    if isinstance(body, bytes):
        case.path_parameters["sha256"] = hashlib.sha256(body).hexdigest()
