"""schemathesis hooks for fanroute's apps (``SCHEMATHESIS_HOOKS=tests.contract.hooks``): what no JSON
Schema can say.

- ``application/x-ndjson`` (the gateway's episodes push) is sent as one JSON document per line, an
  array body being its lines;
- ``PUT /v1/blobs/{sha256}``: the body must hash to the path, so a positive case gets the hash of its body.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import schemathesis


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    lines = value if isinstance(value, list) else [value]
    return b"\n".join(json.dumps(v).encode() for v in lines)


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    op = case.operation
    if (op.method.upper(), op.path) != ("PUT", "/v1/blobs/{sha256}") or \
            (case.meta is not None and case.meta.generation.mode.is_negative):
        return
    body = case.body if isinstance(case.body, bytes) else getattr(case.body, "data", None)
    if isinstance(body, bytes):
        case.path_parameters["sha256"] = hashlib.sha256(body).hexdigest()
