"""Base class and decoding rules shared by every topic message."""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from schemas.errors import SchemaError, UnknownSchemaVersion

M = TypeVar("M", bound="Message")


class Message(BaseModel):
    """A frozen, strictly-shaped message; subclasses pin ``schema_version`` with a Literal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The versions this build can read; a breaking change gets a new topic suffix instead.
    READS_VERSIONS: ClassVar[tuple[int, ...]] = (1,)

    def to_bytes(self) -> bytes:
        """The canonical JSON encoding used on the wire (sorted keys, no spaces)."""
        return wire_json(self.model_dump(mode="json"))


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON: the basis of every content-derived id.

    Always the standard library's encoder, so an id never changes with the encoder a build has."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def wire_json(obj: Any) -> bytes:
    """Sorted-key compact JSON for a message on the wire or in a store: orjson (≈ 8× the standard
    encoder; it is on the gateway's request path), the standard encoder for what orjson refuses
    (integers past 64 bits). It decodes to what :func:`canonical_json` does; floats may be spelled
    differently (``1e-5`` for ``1e-05``), which is why ids are not derived from it."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return canonical_json(obj)


def fast_loads(raw: bytes | str) -> Any:
    """``json.loads`` through orjson; the standard decoder for what orjson refuses but it reads
    (``NaN``, ``Infinity``), so what is accepted does not change. ``ValueError`` when neither reads it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def content_id(*parts: Any, length: int = 32) -> str:
    """A hex id derived from content, so a replay produces the same id."""
    return hashlib.sha256(canonical_json(list(parts))).hexdigest()[:length]


def decode(cls: type[M], raw: bytes | str | dict[str, Any]) -> M:
    """Parse ``raw`` as ``cls``; unknown ``schema_version`` and bad shapes raise :class:`SchemaError`."""
    if isinstance(raw, (bytes, str)):
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SchemaError(f"{cls.__name__}: not valid JSON ({exc})") from exc
    else:
        data = raw
    if not isinstance(data, dict):
        raise SchemaError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version not in cls.READS_VERSIONS:
        raise UnknownSchemaVersion(
            f"{cls.__name__}: schema_version {version!r} is not one this build reads "
            f"{list(cls.READS_VERSIONS)}; a breaking change must use a new topic suffix"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(f"{cls.__name__}: {summarise(exc)}") from exc


def summarise(exc: ValidationError, limit: int = 5) -> str:
    """Field errors on one line (``path: message; ...``), at most ``limit`` of them."""
    errs = exc.errors()
    lines = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errs[:limit]]
    more = f" (+{len(errs) - limit} more)" if len(errs) > limit else ""
    return "; ".join(lines) + more
