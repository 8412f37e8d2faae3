"""The vLLM adapter loader: announced versions pulled, verified and loaded over vLLM's LoRA endpoints.

vLLM itself is stood in for by an ``httpx.MockTransport`` that keeps the loaded names the way the
real server answers (``make test-vllm`` runs the loader against the real one)."""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from schemas.adapter import AdapterPublished
from services.common.settings import KafkaSettings
from services.sampler.app import create_app
from services.sampler.settings import SamplerSettings
from services.sampler.vllm_loader import VllmAdapters, VllmUnreachable
from tests.support.tiny_model import build_lora_adapter, build_tiny_model


class FakeVllm:
    """vLLM's two runtime LoRA endpoints, answering as vLLM 0.32 does."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []
        self.down = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        body = json.loads(request.content)
        self.calls.append((request.url.path, body))
        name = body["lora_name"]
        if request.url.path == "/v1/load_lora_adapter":
            if name in self.loaded:
                return httpx.Response(400, json={"error": {"message": f"The lora adapter '{name}' has already "
                                                                      "been loaded."}})
            if not (Path(body["lora_path"]) / "adapter_config.json").is_file():
                return httpx.Response(400, json={"error": {"message": "No adapter found"}})
            self.loaded[name] = body["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in self.loaded:
            return httpx.Response(404, json={"error": {"message": f"The lora adapter '{name}' cannot be found."}})
        del self.loaded[name]
        return httpx.Response(200, text="Success")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm-loader")
    return build_lora_adapter(build_tiny_model(root / "base"), root / "lora", seed=1)


def announcement(adapter: Path, version: int) -> AdapterPublished:
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in adapter.iterdir()
             if p.name.startswith("adapter_")}
    return AdapterPublished(model_id="router", version=version, base_model="tiny", files_sha256=files,
                            url=f"http://publisher/v1/adapters/router/{version}", published_at=datetime.now(UTC))


def loader(tmp_path: Path, adapter: Path, fake: FakeVllm, **kw) -> VllmAdapters:
    def fetcher(model_id, version, url, files_sha256, dest_dir):
        shutil.copytree(adapter, dest_dir, dirs_exist_ok=True)
        return dest_dir

    settings = SamplerSettings(base_model="unused", adapter_cache_dir=tmp_path / "cache", consume_adapters=False,
                               kafka=KafkaSettings(bootstrap_servers="memory://"), vllm_url="http://vllm:8002", **kw)
    return VllmAdapters(settings, "http://vllm:8002", fetcher=fetcher, transport=httpx.MockTransport(fake))


async def test_announced_versions_are_pulled_and_loaded_by_their_versioned_name(tmp_path, adapter) -> None:
    fake = FakeVllm()
    lo = loader(tmp_path, adapter, fake, max_resident_adapters=2)
    await lo.start()
    for v in (1, 2, 3):
        await lo.worker.handle(announcement(adapter, v))
    # at most two resident: router@1 was unloaded from vLLM when router@3 came
    assert set(fake.loaded) == {"router@2", "router@3"}
    assert ("/v1/unload_lora_adapter", {"lora_name": "router@1"}) in fake.calls
    assert Path(fake.loaded["router@3"]).is_relative_to(tmp_path / "cache")  # vLLM reads the verified copy
    assert len(lo.load_seconds) == 3
    await lo.worker.handle(announcement(adapter, 1))  # older than the newest: kept for on demand, not loaded
    assert "router@1" not in fake.loaded
    await lo.stop()


async def test_a_restart_loads_the_cached_newest_and_tolerates_already_loaded(tmp_path, adapter) -> None:
    fake = FakeVllm()
    first = loader(tmp_path, adapter, fake)
    await first.start()
    await first.worker.handle(announcement(adapter, 4))
    await first.stop()
    again = loader(tmp_path, adapter, fake)  # vLLM kept router@4: its 400 "already loaded" is fine
    await again.start()
    assert again.registry.is_resident("router@4") and list(fake.loaded) == ["router@4"]
    await again.stop()


async def test_vllm_down_is_a_transient_error_and_nothing_is_kept(tmp_path, adapter) -> None:
    fake = FakeVllm()
    fake.down = True
    lo = loader(tmp_path, adapter, fake)
    await lo.start()
    with pytest.raises(VllmUnreachable):
        await lo.worker.handle(announcement(adapter, 5))  # the bus retries a TransientError
    assert lo.registry.get("router@5") is None
    fake.down = False
    await lo.worker.handle(announcement(adapter, 5))  # the retry lands
    assert "router@5" in fake.loaded
    await lo.stop()


async def test_the_sampler_with_vllm_url_serves_the_loader_and_no_model(tmp_path) -> None:
    settings = SamplerSettings(base_model="/nonexistent", adapter_cache_dir=tmp_path / "cache",
                               consume_adapters=False, kafka=KafkaSettings(bootstrap_servers="memory://"),
                               vllm_url="http://127.0.0.1:9")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://loader") as c:
            body = (await c.get("/healthz")).json()
            assert body["vllm_url"] == "http://127.0.0.1:9" and body["resident"] == []
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 404  # no model here
