"""The running sampler: the engine, the adapter registry and the adapters-topic worker.

:class:`Sampler` loads the base model once, keeps LoRA adapters resident (least recently used out
first), serializes every use of the model behind the engine's lock, and checks prompts against
vLLM's context-length rules; :class:`SamplerMetrics` counts what it does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.adapter import parse_versioned
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import TransientError
from services.sampler.batching import ScoreBatcher, ScoreJob
from services.sampler.decoding import Decoder, OnToken
from services.sampler.engine import Engine, Generation, SamplingParams
from services.sampler.registry import (
    AdapterEntry,
    AdapterError,
    AdapterRegistry,
    AdapterUnavailable,
    check_adapter_dir,
)
from services.sampler.scoring import PrefixCache, Scored, Scorer
from services.sampler.settings import SamplerSettings
from services.sampler.wire import (
    ApiError,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
)
from services.sampler.worker import (
    AdapterStore,
    AdapterWorker,
    Fetcher,
    default_fetcher,
)

log = logging.getLogger(__name__)


class SamplerMetrics:
    """Requests, tokens, generation time and adapter churn."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fanroute_sampler_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.tokens = Counter("fanroute_sampler_tokens", "Tokens processed", ["kind"], registry=self.registry)
        self.generation_seconds = Histogram("fanroute_sampler_generation_seconds", "Time of one generation",
                                            registry=self.registry)
        self.adapter_events = Counter("fanroute_sampler_adapter_events", "Adapter loads, evictions, refusals",
                                      ["event"], registry=self.registry)
        self.resident = Gauge("fanroute_sampler_adapters_resident", "Adapters in memory", registry=self.registry)
        self.merged = Gauge("fanroute_sampler_merged_copies", "Adapters scored through a merged copy",
                            registry=self.registry)
        self.score_batch = Histogram("fanroute_sampler_score_batch_requests", "Requests scored by one batch",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.score_seconds = Histogram("fanroute_sampler_score_seconds", "Time of one scoring batch",
                                       registry=self.registry)
        self.score_batch_wait = Histogram(
            "fanroute_sampler_score_batch_wait_seconds",
            "How long a scoring batch waited for more requests before its forward",
            buckets=(0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.02, 0.05, 0.1), registry=self.registry)
        self.score_forwards = Counter("fanroute_sampler_score_forwards", "Scoring forwards by prefix-cache outcome",
                                      ["cache"], registry=self.registry)


class Sampler:
    """Engine + adapter registry + the adapters-topic worker of one running sampler."""

    def __init__(self, settings: SamplerSettings, *, engine: Engine | None = None, bus: Bus | None = None,
                 fetcher: Fetcher | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.bus = bus or Bus(settings.kafka, client_id="fanroute-sampler")
        self.registry = AdapterRegistry(settings.max_resident_adapters)
        store = AdapterStore(settings.adapter_cache_dir,
                             fetcher or default_fetcher(settings.publisher_url, settings.fetch_timeout_s))
        self.worker = AdapterWorker(self, store, publisher_url=settings.publisher_url,
                                    accept_base_models=settings.accept_base_models)
        self.metrics = SamplerMetrics()
        self._slots = 0
        self._to_merge: list[tuple[str, str]] = []  # (name, slot) loaded but not yet given a merged copy
        self._merging = threading.Lock()  # one copy built at a time (each is a copy of the weights)
        self.scorer: Scorer | None = None
        self.batcher = ScoreBatcher(self._score_locked, max_batch=settings.score_max_batch,
                                    wait_s=settings.score_batch_wait_ms / 1000,
                                    max_wait_s=settings.score_batch_max_wait_s,
                                    on_wait=self.metrics.score_batch_wait.observe)
        self.decoder: Decoder | None = None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    async def start(self) -> None:
        """Load the base model (once), restore cached adapters, then follow the adapters topic."""
        if self.engine is None:
            s = self.settings
            self.engine = await asyncio.to_thread(Engine, s.base_model, dtype=s.dtype,
                                                  max_model_len=s.max_model_len, threads=s.threads)
        s = self.settings
        if self.engine.prefix_cache is None:  # an engine shared by two samplers keeps one cache
            self.engine.prefix_cache = PrefixCache(s.prefix_cache_entries, s.prefix_cache_min_tokens)
        self.scorer = Scorer(self.engine, self.engine.prefix_cache, top_k_cached=s.max_logprobs,
                             max_forward_tokens=s.score_max_forward_tokens, row_tokens=s.score_row_tokens)
        self.decoder = Decoder(self.engine, self._slot_of, max_num_seqs=s.max_num_seqs)
        restored = self.worker.restore()
        if restored:
            log.info("restored %d verified adapter versions from %s", restored, self.settings.adapter_cache_dir)
        if self.settings.consume_adapters:
            self.bus.subscribe(topic("adapters"), self.worker.handle, group_id=self.settings.consumer_group)
            await self.bus.start((topic("adapters"),))

    async def stop(self) -> None:
        await self.batcher.stop()
        if self.decoder is not None:
            await asyncio.to_thread(self.decoder.stop)
        if self.settings.consume_adapters:
            await self.bus.stop()

    # -------------------------------------------------------------------- adapters
    async def register(self, entry: AdapterEntry, *, replace: bool = False) -> None:
        """Check ``entry``'s dir, then add it and make it resident; nothing is kept if either step fails."""
        cfg = check_adapter_dir(entry.path, max_rank=self.settings.max_lora_rank)
        entry.rank = cfg["r"]
        await asyncio.to_thread(self._register_locked, entry, replace)

    def _register_locked(self, entry: AdapterEntry, replace: bool) -> None:
        with self.eng.lock:
            old = self.registry.get(entry.name)
            if old is not None and replace:
                self._evict(old)  # the new entry takes its name (and keeps the aliases to it)
            self.registry.add(entry)
            try:
                self._resident_slot(entry, background=False)
            except Exception:
                self.registry.remove(entry.name)
                self.metrics.adapter_events.labels("refused").inc()
                raise
        self._merge_pending()  # outside the engine's lock: requests go on while the copy is built

    def _resident_slot(self, entry: AdapterEntry, *, background: bool = True) -> str:
        """``entry``'s slot, loading it (and evicting the least recently used) if needed; hold the lock.
        A slot loaded here that gets a merged copy is queued for one, built by a background thread
        (``background``) or by the caller once it has released the lock."""
        if self.registry.get(entry.name) is not entry:
            raise AdapterUnavailable(f"The model `{entry.name}` was unloaded")
        if not self.registry.is_resident(entry.name) or entry.slot is None:
            for name in self.registry.to_evict_for(entry.name):
                victim = self.registry.get(name)
                if victim is not None:
                    self._evict(victim)
                self.registry.mark_evicted(name)
            self._slots += 1
            slot = f"lora{self._slots}"
            self.eng.load_adapter(slot, entry.path)
            entry.slot = slot
            self.metrics.adapter_events.labels("loaded").inc()
            if self.settings.merged_copies and entry.model_id in self.settings.merged_models:
                self._to_merge.append((entry.name, slot))
                if background:
                    threading.Thread(target=self._merge_pending, name="sampler-merge", daemon=True).start()
        self.registry.mark_resident(entry.name)
        self.metrics.resident.set(len(self.registry.resident()))
        return entry.slot

    def _merge_pending(self) -> None:
        """Build the queued merged copies, one at a time, without holding the engine's lock."""
        with self._merging:
            while True:
                with self.eng.lock:
                    if not self._to_merge:
                        return
                    name, slot = self._to_merge.pop(0)
                    if slot not in self.eng.slots:  # evicted before its copy was built
                        continue
                self._merge(name, slot)

    def _merge(self, name: str, slot: str) -> None:
        """Score ``slot`` through a merged copy; one that cannot be built is logged and counted, and the
        version is scored through peft (the copy only saves time)."""
        try:
            built = self.eng.merge(slot, keep=self.settings.merged_copies, fuse=self.settings.fused_layers,
                                   attempts=self.settings.merged_build_attempts, dtype=self.settings.merged_dtype)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the copy: serve it unmerged
            self.metrics.adapter_events.labels("merge_failed").inc()
            log.warning("%s is scored through peft: its merged copy failed: %s: %s", name, type(exc).__name__, exc)
        else:
            if built:
                self.metrics.adapter_events.labels("merged").inc()
        self.metrics.merged.set(len(self.eng.merged))

    def _evict(self, entry: AdapterEntry) -> None:
        if entry.slot is not None:
            self.eng.unload_adapter(entry.slot)
            entry.slot = None
            self.metrics.adapter_events.labels("evicted").inc()
            self.metrics.merged.set(len(self.eng.merged))
        self.registry.mark_evicted(entry.name)
        self.metrics.resident.set(len(self.registry.resident()))

    async def load_lora(self, req: LoadLoRAAdapterRequest) -> str:
        """vLLM's load_lora_adapter: validate, load (pre-loading it), and answer its success text."""
        name, path = req.lora_name.strip(), req.lora_path.strip()
        if not name or not path:
            raise ApiError(400, "invalid_request", "Both 'lora_name' and 'lora_path' must be provided.",
                           vllm_type="InvalidUserInput")
        if name == self.model_name:
            raise ApiError(400, "invalid_request", f"'{name}' is the base model's name",
                           vllm_type="InvalidUserInput", param="lora_name")
        if self.registry.get(name) is not None and not req.load_inplace:
            raise ApiError(400, "already_loaded", f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.",
                           vllm_type="InvalidUserInput", param="lora_name")
        parsed = parse_versioned(name)
        entry = AdapterEntry(name, Path(path).expanduser(), model_id=parsed[0] if parsed else None,
                             version=parsed[1] if parsed else None)
        await self.register(entry, replace=req.load_inplace)
        if parsed and parsed[1] >= (self.registry.newest_version(parsed[0]) or 0) \
                and self.registry.get(parsed[0]) is None:
            self.registry.point_alias(parsed[0], name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora(self, req: UnloadLoRAAdapterRequest) -> str:
        """vLLM's unload_lora_adapter: an adapter name frees it; an alias name drops the alias only."""
        name = req.lora_name
        entry = self.registry.get(name)
        if entry is None:
            if not self.registry.drop_alias(name):
                raise ApiError(404, "adapter_not_found", f"The lora adapter '{name}' cannot be found.",
                               vllm_type="NotFoundError", param="lora_name")
        else:
            await asyncio.to_thread(self._unload_locked, entry)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _unload_locked(self, entry: AdapterEntry) -> None:
        with self.eng.lock:
            self._evict(entry)
            self.registry.remove(entry.name)

    async def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter ``model`` names (None = the base), fetched on demand if it is unknown here."""
        if model is None or model == self.model_name:
            return None
        try:
            return await self.worker.ensure(model)
        except TransientError as exc:  # the publisher is briefly down: the same request may work later
            self.metrics.adapter_events.labels("source_unreachable").inc()
            raise ApiError(503, "adapter_source_unreachable", str(exc), vllm_type="ServiceUnavailableError",
                           param="model") from exc
        except AdapterUnavailable as exc:
            self.metrics.adapter_events.labels("unavailable").inc()
            raise ApiError(404, "model_not_found", str(exc), vllm_type="NotFoundError", param="model") from exc
        except AdapterError as exc:
            raise ApiError(404, "model_not_found", f"The model `{model}` could not be loaded: {exc}",
                           vllm_type="NotFoundError", param="model") from exc

    # -------------------------------------------------------------------- generation
    @property
    def eng(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the sampler has not started: no engine")
        return self.engine

    async def generate(self, entry: AdapterEntry | None, prompt_ids: list[int],
                       params: SamplingParams, on_token: OnToken | None = None) -> Generation:
        """One generation, decoded together with every other active one (continuous batching);
        ``on_token`` hears each new token (in the decoding thread), for streaming."""
        if self.decoder is None:
            raise RuntimeError("the sampler has not started: no decoder")
        gen = await self.decoder.generate(entry, prompt_ids, params, on_token)
        self.metrics.tokens.labels("prompt").inc(len(prompt_ids))
        self.metrics.tokens.labels("completion").inc(len(gen.token_ids))
        self.metrics.generation_seconds.observe(gen.seconds)
        return gen

    def _slot_of(self, entry: AdapterEntry | None) -> str | None:
        """The slot a decoding step runs ``entry`` through (made resident if it was evicted; lock held)."""
        return self._resident_slot(entry) if entry is not None else None

    async def score(self, entry: AdapterEntry | None, prompts: list[list[int]], k: int | None,
                    params: list[SamplingParams]) -> list[tuple[Scored, Generation]]:
        """Every prompt token's logprob (``k`` alternatives each; None: lean, none) and the generation after
        each prompt: scored together with concurrent requests for the same adapter; a ``max_tokens`` of 1 is drawn
        from the scoring pass's last row, a longer one generated as usual."""
        scored = await self.batcher.score(entry, prompts, [k] * len(prompts))

        async def after(ids: list[int], sc: Scored, p: SamplingParams) -> Generation:
            if p.max_tokens != 1:
                return await self.generate(entry, ids, p)
            gen = self.eng.first_token(ids, sc.row, p)
            self.metrics.tokens.labels("completion").inc(len(gen.token_ids))
            return gen

        gens = await asyncio.gather(*(after(ids, sc, p) for ids, sc, p in zip(prompts, scored, params)))
        return list(zip(scored, gens))

    def _score_locked(self, entry: AdapterEntry | None, jobs: list[ScoreJob]) -> list[list[Scored]]:
        """One batch of scoring jobs (same adapter), in a worker thread, holding the engine's lock."""
        if self.scorer is None:
            raise RuntimeError("the sampler has not started: no scorer")
        with self.eng.lock:
            slot = self._resident_slot(entry) if entry is not None else None
            scored, info = self.scorer.score([p for j in jobs for p in j.prompts],
                                             [k for j in jobs for k in j.ks], slot)
        self.metrics.score_batch.observe(len(jobs))
        self.metrics.tokens.labels("prompt").inc(info.prompt_tokens)
        self.metrics.tokens.labels("prompt_reused").inc(info.reused_tokens)
        self.metrics.tokens.labels("prompt_forwarded").inc(info.forwarded_tokens)
        for outcome in info.cache:
            self.metrics.score_forwards.labels(outcome).inc()
        self.metrics.score_seconds.observe(info.seconds)
        out, at = [], 0
        for j in jobs:
            out.append(scored[at:at + len(j.prompts)])
            at += len(j.prompts)
        return out

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """Validate token ids and length; returns the max_tokens to use (vLLM's context-length rules)."""
        if not prompt_ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        vocab = self.eng.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is out of vocabulary [0, {vocab})", param)
        limit, n = self.eng.max_model_len, len(prompt_ids)
        if n >= limit:
            raise ApiError(400, "prompt_too_long", f"This model's maximum context length is {limit} tokens. "
                           f"However, your prompt has {n} tokens. Please reduce the length of the prompt.",
                           param=param)
        if max_tokens is None:
            return min(self.settings.max_tokens_limit, limit - n)
        if max_tokens > self.settings.max_tokens_limit:
            raise bad_request(f"max_tokens: {max_tokens} is over this server's limit of "
                              f"{self.settings.max_tokens_limit}", "max_tokens")
        if n + max_tokens > limit:
            raise ApiError(400, "prompt_too_long", f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} "
                           "in the completion). Please reduce the length of the messages or completion.",
                           param="max_tokens")
        return max_tokens
