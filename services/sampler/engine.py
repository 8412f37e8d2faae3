"""The CPU generation engine: one base causal LM, LoRA adapters in named peft slots, token-level sampling.

Generation is our own loop over the model's forward pass with a KV cache, so the token ids and the
log-probabilities we return are exactly what the model computed: each step's logprob is the raw
log-softmax of that step's logits (before temperature / top-p / top-k, as vLLM's default
``raw_logprobs`` mode reports them). A teacher-forced forward pass over prompt + sampled tokens
reproduces them. The engine is not thread-safe by itself; hold :attr:`Engine.lock` around a
sequence of calls. :meth:`generate` decodes one request alone; :meth:`prefill` and
:meth:`decode_step` are the two halves :mod:`services.sampler.decoding` batches many requests with.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.common.errors import FanrouteError
from services.sampler.registry import AdapterError

log = logging.getLogger(__name__)
PREFILL_KEPT = 8  # generation prompts whose keys/values a later prefill may reuse
PREFILL_MIN_REUSE = 16  # shorter shared prefixes are forwarded again
FinishReason = Literal["stop", "length"]


class PromptError(FanrouteError, ValueError):
    """A prompt cannot be built, e.g. chat messages for a tokenizer without a chat template."""


@dataclass(frozen=True)
class SamplingParams:
    """What one generation may do; validated by the HTTP layer before it gets here."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per step to report; None = none
    skip_special_tokens: bool = True


@dataclass
class Generation:
    """One finished generation: sampled ids, their raw logprobs and (if asked) each step's alternatives."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # sampled first, then top-k
    text: str = ""
    finish_reason: FinishReason = "length"
    stop_reason: str | int | None = None
    seconds: float = 0.0


class Engine:
    """A base model loaded once, plus peft LoRA adapters loaded into named slots on the same weights."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", max_model_len: int | None = None,
                 threads: int | None = None) -> None:
        import torch
        from transformers import AutoTokenizer

        from services.models.load import load_causal_lm, require_local

        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.model_dir = require_local(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = load_causal_lm(self.model_dir, getattr(torch, dtype)).eval()
        self._peft: Any = None  # peft.PeftModel wrapping self.model once the first adapter is loaded
        self.lock = threading.RLock()
        self.prefix_cache: Any = None  # a scoring.PrefixCache, when the sampler scores prompts
        self._active: tuple[str | None] | None = None  # (slot,) the forward passes go through; None: unknown
        self._merged: OrderedDict[str | None, Any] = OrderedDict()  # slot → merged copy for scoring (merged.py)
        self._epoch = 0  # bumped by every adapter load and unload: a copy built across one may be torn
        self._token_texts: dict[int, str] = {}
        self._prefills: OrderedDict[tuple[str | None, tuple[int, ...]], list[list[Any]]] = OrderedDict()
        self.prefill_tokens_reused = 0
        context = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or context, context)
        self.eos_token_ids = self._eos_ids()
        # transformers 5 renamed forward's ``past_key_values`` to ``cache``; older ones lack ``logits_to_keep``
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        log.info("loaded %s (%s, context %d) in %.1fs", self.model_dir, dtype, self.max_model_len,
                 time.perf_counter() - t0)

    def _eos_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return frozenset(i for i in ids if i is not None)

    # ----------------------------------------------------------------- text <-> ids
    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (special tokens added as the tokenizer defines, like vLLM)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Render ``messages`` with the tokenizer's chat template (plus the generation prompt), then tokenize."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("the base model's tokenizer has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens kept), as logprob entries name them (memoised)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ---------------------------------------------------------------------- adapters
    @property
    def slots(self) -> list[str]:
        return list(self._peft.peft_config) if self._peft is not None else []

    def load_adapter(self, slot: str, path: Path) -> None:
        """Load the LoRA adapter in ``path`` into ``slot``; a failure leaves no half-loaded slot behind."""
        from peft import PeftModel

        from services.common.hf import model_loading
        from services.models.adapters import check_adapter_fits

        t0 = time.perf_counter()
        with self.lock, model_loading(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft warns on every extra adapter: that is the point here
            self._forget(slot)
            try:
                check_adapter_fits(self.model, path)  # peft would load another base's adapter without a word
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self.model, str(path), adapter_name=slot,
                                                           is_trainable=False)
                else:
                    self._peft.load_adapter(str(path), adapter_name=slot, is_trainable=False)
            except Exception as exc:
                if self._peft is not None and slot in self._peft.peft_config:
                    self._peft.delete_adapter(slot)
                raise AdapterError(f"{path}: cannot load into the base model: {type(exc).__name__}: {exc}") from exc
            self.model.eval()
        log.info("adapter %s loaded into slot %s in %.2fs", path, slot, time.perf_counter() - t0)

    def unload_adapter(self, slot: str) -> None:
        """Free ``slot`` (no-op if it is not loaded)."""
        with self.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._forget(slot)
            if self._peft is not None and slot in self._peft.peft_config:
                self._peft.delete_adapter(slot)

    def _forget(self, slot: str) -> None:
        """Drop what the prefix cache holds for ``slot`` and its merged copy (its weights are about to
        change) and forget which slot is active (peft switches on loads and deletes)."""
        self._active = None
        self._epoch += 1
        for key in [k for k in self._prefills if k[0] == slot]:
            del self._prefills[key]
        self.unmerge(slot)
        if self.prefix_cache is not None:
            self.prefix_cache.drop(slot)

    # ------------------------------------------------------------------ merged copies
    @property
    def merged(self) -> list[str | None]:
        """The slots scored through a merged copy, oldest first."""
        return list(self._merged)

    def merge(self, slot: str | None, *, keep: int = 1, fuse: bool = True, attempts: int = 3,
              dtype: str = "same") -> bool:
        """Score ``slot`` (None: the base) through a copy with its LoRA folded in and its linear weights
        packed (:mod:`services.sampler.merged`; ``fuse``: its Llama layers fused where they can be,
        :mod:`services.sampler.fused`; ``dtype``: :func:`~services.sampler.merged.scoring_dtype`'s choice);
        the oldest copies beyond ``keep`` are dropped. False when the slot
        was unloaded while its copy was being built (nothing installed).

        The copy is built *outside* the engine's lock — 0.3–0.6 s on a quiet machine, seconds under load,
        during which scoring and generation go on (``slot`` through peft) — and installed under it. A
        load or unload in the meantime may have torn the deep copy, so it is then built again; after
        ``attempts`` such races (0: at once) it is built under the lock."""
        from services.sampler.merged import merged_copy, scoring_dtype

        t0 = time.perf_counter()
        want = scoring_dtype(dtype, self.model.dtype)
        for _ in range(attempts):
            with self.lock:
                if slot is not None and slot not in self.slots:
                    raise AdapterError(f"adapter slot {slot!r} is not loaded")
                epoch = self._epoch
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    copy = merged_copy(self.model, slot, fuse=fuse, dtype=want)
            except Exception:
                with self.lock:
                    if self._epoch == epoch:
                        raise  # a failure of its own, not a race with a load
                    if slot is not None and slot not in self.slots:
                        return False
                continue
            with self.lock:
                if self._epoch == epoch:
                    self._install(slot, copy, keep, time.perf_counter() - t0)
                    return True
                if slot is not None and slot not in self.slots:
                    return False
            log.info("slot %s: an adapter load or unload raced its merged copy; building it again", slot)
        with self.lock, warnings.catch_warnings():  # loads keep racing it: build it where none can
            warnings.simplefilter("ignore")
            if slot is not None and slot not in self.slots:
                return False
            self._install(slot, merged_copy(self.model, slot, fuse=fuse, dtype=want), keep,
                          time.perf_counter() - t0)
        return True

    def _install(self, slot: str | None, copy: Any, keep: int, seconds: float) -> None:
        """Put ``slot``'s new copy in place of its old one (hold the lock)."""
        self.unmerge(slot)
        self._merged[slot] = copy
        while len(self._merged) > max(keep, 1):
            self.unmerge(next(iter(self._merged)))
        log.info("slot %s merged for scoring in %.2fs", slot, seconds)

    def unmerge(self, slot: str | None) -> None:
        """Drop ``slot``'s merged copy and what the prefix cache holds from it (no-op without one)."""
        from services.sampler.merged import cache_key

        with self.lock:
            if self._merged.pop(slot, None) is not None and self.prefix_cache is not None:
                self.prefix_cache.drop(cache_key(slot))

    def scoring_model(self, slot: str | None) -> tuple[Any, str | None]:
        """(the model scoring runs ``slot`` through, the prefix-cache key of what it computes): the merged
        copy where there is one, else the engine's model with ``slot`` active (hold the lock)."""
        if slot in self._merged:
            from services.sampler.merged import cache_key

            return self._merged[slot], cache_key(slot)
        self._activate(slot)
        return self.model, slot

    def _activate(self, slot: str | None) -> None:
        """Route the next forward passes through ``slot``'s LoRA weights, or through the base alone
        (a no-op when it already is: peft walks every module to switch, ~10 ms on SmolLM2)."""
        if self._active == (slot,):
            return
        self._active = None
        self._switch(slot)
        self._active = (slot,)

    def _switch(self, slot: str | None) -> None:
        if self._peft is None:
            if slot is not None:
                raise AdapterError(f"adapter slot {slot!r} is not loaded")
            return
        if slot is None:
            self._peft.base_model.disable_adapter_layers()
            return
        if slot not in self._peft.peft_config:
            raise AdapterError(f"adapter slot {slot!r} is not loaded")
        self._peft.base_model.enable_adapter_layers()
        self._peft.set_adapter(slot)

    # --------------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[int], params: SamplingParams, *, slot: str | None = None) -> Generation:
        """Sample up to ``params.max_tokens`` tokens after ``prompt_ids`` with ``slot``'s adapter (None = base)."""
        import torch

        t0 = time.perf_counter()
        gen = Generation(prompt_token_ids=list(prompt_ids), token_ids=[], logprobs=[])
        rng = _rng(params.seed)
        stops = tuple(s for s in params.stop if s)
        with self.lock, torch.inference_mode():
            self._activate(slot)
            kv = {self._cache_kwarg: self._new_cache()}  # filled in place, step by step
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True, **self._keep_last, **kv)
            for _ in range(params.max_tokens):
                logits_V = out.logits[0, -1].float()
                token = self._step(gen, logits_V, torch.log_softmax(logits_V, dim=-1), params, rng)
                if self._finished(gen, token, params, stops):
                    break
                out = self.model(input_ids=torch.tensor([[token]]), use_cache=True, **kv)
        return self._done(gen, params, t0)

    def prefill(self, prompt_ids: list[int], slot: str | None) -> tuple[Any, Any]:
        """A new sequence's batch-1 KV cache over ``prompt_ids`` and the logits after it (hold the lock).

        The longest prefix already computed for ``slot`` (a recent generation's prompt, or a scoring
        prefix) is copied in and only the rest is forwarded: a rollout group's prompts, or router
        prompts sharing the system turn, are prefilled once. What is kept are the prompt's own
        tensors (a cache only grows by concatenation, never in place)."""
        import torch

        from services.sampler.kvbatch import cache_layers

        self._activate(slot)
        reused, kv = self._known_prefix(slot, prompt_ids)
        cache = self._new_cache([(k[:, :, :reused], v[:, :, :reused]) for k, v in kv] if reused else None)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([prompt_ids[reused:]]), use_cache=True, **self._keep_last,
                             **{self._cache_kwarg: cache})
        self.prefill_tokens_reused += reused
        if len(prompt_ids) >= PREFILL_MIN_REUSE:
            self._prefills[(slot, tuple(prompt_ids))] = cache_layers(cache)
            while len(self._prefills) > PREFILL_KEPT:
                self._prefills.popitem(last=False)
        return cache, out.logits[0, -1].float()

    def _known_prefix(self, slot: str | None, prompt_ids: list[int]) -> tuple[int, list[list[Any]]]:
        """(tokens to reuse, per-layer [keys, values]) of the longest known prefix of ``prompt_ids``
        for ``slot``; at least one token is left to forward, and short overlaps are not worth it."""
        from services.sampler.scoring import shared_length

        best, kv = 0, []
        for (s, tokens), layers in self._prefills.items():
            if s == slot and (n := shared_length(tokens, prompt_ids)) > best:
                best, kv = n, layers
        if self.prefix_cache is not None:
            entry, n = self.prefix_cache.lookup(slot, prompt_ids)
            if entry is not None and n > best:
                best, kv = n, [[k, v] for k, v in zip(entry.keys, entry.values)]
        best = min(best, len(prompt_ids) - 1)
        return (best, kv) if best >= PREFILL_MIN_REUSE else (0, [])

    def decode_step(self, batch: Any, tokens: list[int], slot: str | None) -> Any:
        """Feed one token to every row of ``batch`` (a :class:`~services.sampler.kvbatch.KVBatch`) in
        one forward; the logits after it, ``[B, V]`` (hold the lock)."""
        import torch

        self._activate(slot)
        with torch.inference_mode():
            out = self.model(**batch.step_inputs(tokens), use_cache=True, **{self._cache_kwarg: batch.cache})
        batch.advance()
        return out.logits[:, -1].float()

    def first_token(self, prompt_ids: list[int], logprobs_V: Any, params: SamplingParams) -> Generation:
        """What :meth:`generate` gives with ``max_tokens=1``, from the log-softmax row after the prompt
        that a scoring pass already computed (softmax, greedy and the filters ignore the shift)."""
        t0 = time.perf_counter()
        gen = Generation(prompt_token_ids=list(prompt_ids), token_ids=[], logprobs=[])
        token = self._step(gen, logprobs_V, logprobs_V, params, _rng(params.seed))
        self._finished(gen, token, params, tuple(s for s in params.stop if s))
        return self._done(gen, params, t0)

    def _step(self, gen: Generation, logits_V: Any, logprobs_V: Any, params: SamplingParams, rng: Any) -> int:
        """Pick the next token and record its raw logprob (and the alternatives asked for)."""
        token = _pick(logits_V, params, rng)
        gen.token_ids.append(token)
        gen.logprobs.append(float(logprobs_V[token]))
        if params.logprobs is not None:
            gen.top_logprobs.append(_top_entries(logprobs_V, token, params.logprobs))
        return token

    def _done(self, gen: Generation, params: SamplingParams, t0: float) -> Generation:
        if not isinstance(gen.stop_reason, str):  # a stop string already cut the text
            gen.text = self.decode(gen.token_ids, skip_special_tokens=params.skip_special_tokens)
        gen.seconds = time.perf_counter() - t0
        return gen

    def _new_cache(self, data: list[tuple[Any, Any]] | None = None) -> Any:
        """An empty DynamicCache, or one holding ``data`` (per layer: keys, values)."""
        from transformers import DynamicCache

        try:
            return DynamicCache(data, config=self.model.config) if data else DynamicCache(config=self.model.config)
        except TypeError:  # transformers 4.x: no config argument
            return DynamicCache.from_legacy_cache(tuple(data)) if data else DynamicCache()

    def _finished(self, gen: Generation, token: int, params: SamplingParams, stops: tuple[str, ...]) -> bool:
        """Set the finish reason and return True when ``token`` ends the generation."""
        if token in self.eos_token_ids and not params.ignore_eos:
            gen.finish_reason, gen.stop_reason = "stop", None
            return True
        if token in params.stop_token_ids:
            gen.finish_reason, gen.stop_reason = "stop", token
            return True
        if stops:
            text = self.decode(gen.token_ids, skip_special_tokens=params.skip_special_tokens)
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                at, stop = min(hits)
                gen.text, gen.finish_reason, gen.stop_reason = text[:at], "stop", stop
                return True
        return False


def _rng(seed: int | None) -> Any:
    import torch

    rng = torch.Generator()
    if seed is not None:
        rng.manual_seed(seed)
    else:
        rng.seed()
    return rng


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS


def _pick(logits_V: Any, params: SamplingParams, rng: Any) -> int:
    """Greedy when temperature is under :data:`SAMPLING_EPS` (as vLLM: a tinier one would overflow the
    scaled logits), else sample from the temperature / top-k / top-p filtered softmax."""
    import torch

    if params.temperature < SAMPLING_EPS:
        return int(torch.argmax(logits_V))
    scaled_V = logits_V / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < scaled_V.numel():
        kth = torch.topk(scaled_V, params.top_k).values[-1]
        scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
    probs_V = torch.softmax(scaled_V, dim=-1)
    if params.top_p < 1.0:
        sorted_V, order_V = torch.sort(probs_V, descending=True)
        keep_V = torch.cumsum(sorted_V, dim=-1) - sorted_V < params.top_p  # always keeps the first
        probs_V = torch.zeros_like(probs_V).scatter(0, order_V[keep_V], sorted_V[keep_V])
    return int(torch.multinomial(probs_V, 1, generator=rng))


def _top_entries(logprobs_V: Any, sampled: int, k: int) -> list[tuple[int, float]]:
    """The sampled token first, then the ``k`` most likely (without repeating the sampled one), as vLLM orders them."""
    import torch

    entries = [(sampled, float(logprobs_V[sampled]))]
    if k > 0:
        values_K, ids_K = torch.topk(logprobs_V, min(k, logprobs_V.shape[-1]))  # k ≤ vocabulary
        entries += [(int(i), float(v)) for i, v in zip(ids_K, values_K) if int(i) != sampled]
    return entries
