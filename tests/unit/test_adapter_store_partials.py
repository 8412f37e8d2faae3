"""A pull that a kill interrupted leaves a ``.partial-*`` dir; the next start removes it and keeps
what was verified."""

from __future__ import annotations

import json

from services.sampler.registry import AdapterRegistry
from services.sampler.worker import VERIFIED_MARKER, AdapterStore, AdapterWorker


class FakeSampler:
    def __init__(self) -> None:
        self.registry = AdapterRegistry(4)

    async def register(self, entry) -> None:  # pragma: no cover - not called by restore
        self.registry.add(entry)


def test_restore_removes_unfinished_pulls_and_registers_the_verified(tmp_path):
    store = AdapterStore(tmp_path, fetcher=lambda *a: None)
    done = store.dir_for("router", 1)
    done.mkdir(parents=True)
    (done / VERIFIED_MARKER).write_text(json.dumps({"model_id": "router", "version": 1, "files_sha256": {}}))
    half = done.parent / ".partial-2-deadbeef"
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"half")
    sampler = FakeSampler()
    assert AdapterWorker(sampler, store).restore() == 1
    assert not half.exists() and done.is_dir()
    assert sampler.registry.alias_target("router") == "router@1"
