"""Adapters into the real vLLM server: the sampler's adapter worker with vLLM's runtime LoRA endpoints.

Where vLLM serves the student, nothing of the CPU engine runs: this loader follows the ``adapters``
topic exactly as the CPU sampler does (the same :class:`~services.sampler.worker.AdapterWorker`:
pull from the publisher, verify every file's hash, keep it in the adapter cache), and where the CPU
sampler would load the files into a peft slot, it asks vLLM to (``POST /v1/load_lora_adapter``,
the versioned name ``router@N``), unloading the least recently used past ``max_resident_adapters``
(vLLM's ``--max-loras`` should be at least that). vLLM reads the files from the loader's cache
directory, so both must see the same filesystem (one machine, or a shared volume in compose).
vLLM has no aliases: the relay and the gateway ask for ``router@N`` (the Redis stamp), never ``router``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import TransientError
from services.sampler.registry import AdapterEntry, AdapterError, AdapterRegistry, check_adapter_dir
from services.sampler.settings import SamplerSettings
from services.sampler.worker import AdapterStore, AdapterWorker, Fetcher, default_fetcher

log = logging.getLogger(__name__)


class VllmUnreachable(TransientError):
    """The vLLM server did not answer (it may be starting or restarting): the announcement is retried."""


class VllmAdapters:
    """Keeps a vLLM server's LoRA adapters in step with the ``adapters`` topic."""

    def __init__(self, settings: SamplerSettings, vllm_url: str, *, bus: Bus | None = None,
                 fetcher: Fetcher | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.vllm_url = vllm_url.rstrip("/")
        self.bus = bus or Bus(settings.kafka, client_id="fanroute-vllm-adapters")
        self.registry = AdapterRegistry(settings.max_resident_adapters)
        store = AdapterStore(settings.adapter_cache_dir,
                             fetcher or default_fetcher(settings.publisher_url, settings.fetch_timeout_s))
        self.worker = AdapterWorker(self, store, publisher_url=settings.publisher_url,
                                    accept_base_models=settings.accept_base_models)
        self.http = httpx.AsyncClient(base_url=self.vllm_url, timeout=settings.fetch_timeout_s, transport=transport)
        self._lock = asyncio.Lock()
        self.load_seconds: list[float] = []  # each load call's time (publish → serving, less the download)

    async def start(self) -> None:
        """Load what the cache already holds (the newest version per model id), then follow the topic."""
        self.worker.restore()
        for alias, name in self.registry.aliases().items():
            entry = self.registry.get(name)
            if entry is not None:
                try:
                    await self._load(entry)
                except (AdapterError, TransientError) as exc:
                    log.warning("cached %s not loaded into vLLM at start: %s", name, exc)
        if self.settings.consume_adapters:
            self.bus.subscribe(topic("adapters"), self.worker.handle, group_id=self.settings.consumer_group)
            await self.bus.start((topic("adapters"),))

    async def stop(self) -> None:
        if self.settings.consume_adapters:
            await self.bus.stop()
        await self.http.aclose()

    async def register(self, entry: AdapterEntry) -> None:
        """What the worker calls with a pulled, verified version: check it, make it resident in vLLM."""
        cfg = check_adapter_dir(entry.path, max_rank=self.settings.max_lora_rank)
        entry.rank = cfg["r"]
        self.registry.add(entry)
        try:
            await self._load(entry)
        except BaseException:
            self.registry.remove(entry.name)
            raise

    async def _load(self, entry: AdapterEntry) -> None:
        async with self._lock:
            for name in self.registry.to_evict_for(entry.name):
                await self._post("/v1/unload_lora_adapter", {"lora_name": name}, ok_if="not found")
                self.registry.mark_evicted(name)
            t0 = time.perf_counter()
            await self._post("/v1/load_lora_adapter", {"lora_name": entry.name, "lora_path": str(entry.path)},
                             ok_if="already been loaded")
            self.load_seconds.append(time.perf_counter() - t0)
            self.registry.mark_resident(entry.name)
        log.info("adapter %s loaded into vLLM at %s in %.2fs", entry.name, self.vllm_url, self.load_seconds[-1])

    async def _post(self, path: str, body: dict[str, Any], *, ok_if: str) -> None:
        try:
            r = await self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise VllmUnreachable(f"vLLM at {self.vllm_url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500:
            raise VllmUnreachable(f"vLLM at {self.vllm_url} answered {r.status_code} to {path}: {r.text[:300]}")
        if r.status_code != 200 and ok_if not in r.text:
            raise AdapterError(f"vLLM refused {path} {body.get('lora_name')}: HTTP {r.status_code}: {r.text[:300]}")
