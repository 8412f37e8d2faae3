"""Which adapters the sampler knows: name → local dir, model id → version → name, aliases, LRU residency.

Pure bookkeeping (no torch): the engine does the loading; this decides what is known, what a
requested model name means, and which resident adapter to evict next. Also the checks that run
before any adapter file is loaded: is it a PEFT LoRA dir, and do its files hash as announced.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from schemas.adapter import AdapterPublished
from services.common.adapter_files import dir_digest, sha256_file
from services.common.errors import FanrouteError

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(FanrouteError, ValueError):
    """An adapter cannot be used: not a PEFT LoRA dir, incompatible, or not loadable."""


class AdapterIntegrityError(AdapterError):
    """A downloaded adapter file is missing or its sha256 differs from the announced one."""


class AdapterConflict(AdapterError):
    """An announcement names a version this sampler already holds with other files: two contents under
    one name (a Redis that lost the publisher's stamp, a reused broker). Refused, never served."""


class AdapterUnavailable(FanrouteError, LookupError):
    """A requested model name is not known here and could not be fetched."""


@dataclass
class AdapterEntry:
    """One servable adapter: its served name, its local dir and, if published, model id and version."""

    name: str
    path: Path
    model_id: str | None = None
    version: int | None = None
    rank: int | None = None
    slot: str | None = None  # the engine's peft slot while resident
    _sha256: str | None = field(default=None, repr=False)

    @property
    def hashed(self) -> bool:
        """Whether :attr:`sha256` is known without reading the files."""
        return self._sha256 is not None

    @property
    def sha256(self) -> str:
        """The content digest of what is served under this name (hashed from its directory once)."""
        if self._sha256 is None:
            self._sha256 = dir_digest(self.path)
        return self._sha256


class AdapterRegistry:
    """Known adapters, aliases (model id → newest version's name), announcements and the resident LRU."""

    def __init__(self, max_resident: int) -> None:
        if max_resident < 1:
            raise ValueError("max_resident must be at least 1")
        self.max_resident = max_resident
        self._entries: dict[str, AdapterEntry] = {}
        self._aliases: dict[str, str] = {}
        self._announced: dict[str, dict[int, AdapterPublished]] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first

    # ------------------------------------------------------------------ names
    def add(self, entry: AdapterEntry) -> None:
        self._entries[entry.name] = entry

    def remove(self, name: str) -> AdapterEntry | None:
        """Forget ``name`` (and aliases that point at it); returns what was removed."""
        entry = self._entries.pop(name, None)
        for alias in [a for a, target in self._aliases.items() if target == name]:
            del self._aliases[alias]
        self._resident.pop(name, None)
        return entry

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def resolve(self, requested: str) -> AdapterEntry | None:
        """The adapter a request for ``requested`` is served by (an alias is followed once)."""
        if requested in self._entries:
            return self._entries[requested]
        target = self._aliases.get(requested)
        return self._entries.get(target) if target is not None else None

    def point_alias(self, alias: str, name: str) -> None:
        if name not in self._entries:
            raise KeyError(name)
        self._aliases[alias] = name

    def drop_alias(self, alias: str) -> bool:
        return self._aliases.pop(alias, None) is not None

    def alias_target(self, alias: str) -> str | None:
        return self._aliases.get(alias)

    def entries(self) -> list[AdapterEntry]:
        return list(self._entries.values())

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def newest_version(self, model_id: str) -> int | None:
        """The highest version of ``model_id`` that is known (loaded or evicted), if any."""
        versions = [e.version for e in self._entries.values() if e.model_id == model_id and e.version]
        return max(versions, default=None)

    # ----------------------------------------------------------- announcements
    def announce(self, msg: AdapterPublished) -> None:
        """Remember an AdapterPublished so the version can be fetched later, on demand."""
        self._announced.setdefault(msg.model_id, {})[msg.version] = msg

    def announcement(self, model_id: str, version: int | None = None) -> AdapterPublished | None:
        """The announcement of ``model_id@version``, or of its newest announced version."""
        seen = self._announced.get(model_id)
        if not seen:
            return None
        return seen.get(version) if version is not None else seen[max(seen)]

    # -------------------------------------------------------------- residency
    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def resident(self) -> list[str]:
        """Resident adapter names, least recently used first."""
        return list(self._resident)

    def to_evict_for(self, name: str) -> list[str]:
        """Names to evict so that ``name`` can become resident within ``max_resident`` (LRU first)."""
        if name in self._resident:
            return []
        overflow = len(self._resident) + 1 - self.max_resident
        return list(self._resident)[:max(overflow, 0)]

    def mark_resident(self, name: str) -> None:
        """``name`` is now resident and the most recently used."""
        self._resident[name] = None
        self._resident.move_to_end(name)

    def mark_evicted(self, name: str) -> None:
        self._resident.pop(name, None)


# ---------------------------------------------------------------------- checks on disk
def check_adapter_dir(path: Path, *, max_rank: int) -> dict:
    """Return the adapter's config if ``path`` is a PEFT LoRA dir we can serve; else AdapterError."""
    if not path.is_dir():
        raise AdapterError(f"{path}: no such directory")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{path}: not a PEFT adapter (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{cfg_file}: unreadable adapter config: {exc}") from exc
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        got = cfg.get("peft_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise AdapterError(f"{cfg_file}: peft_type is {got!r}; only LORA adapters are served")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise AdapterError(f"{path}: no adapter weights ({' or '.join(WEIGHT_FILES)})")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise AdapterError(f"{cfg_file}: LoRA rank {rank!r} is outside 1..{max_rank} (max_lora_rank)")
    return cfg


def safe_relative(name: str) -> Path:
    """A file name from a manifest as a relative path that cannot leave its directory."""
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts or name.startswith(("/", "\\")):
        raise AdapterIntegrityError(f"{name!r}: file names must be relative paths inside the adapter dir")
    return rel


def verify_files(root: Path, files_sha256: dict[str, str]) -> None:
    """Raise AdapterIntegrityError naming the first file under ``root`` that is missing or differs."""
    if not files_sha256:
        raise AdapterIntegrityError("the announcement lists no files to verify")
    for name, expected in sorted(files_sha256.items()):
        path = root / safe_relative(name)
        if not path.is_file():
            raise AdapterIntegrityError(f"{name}: missing from the downloaded adapter")
        actual = sha256_file(path)
        if actual != expected.lower():
            raise AdapterIntegrityError(f"{name}: sha256 {actual} does not match the announced {expected}")
