"""The trainer's HTTP client of a sampler (the CPU sampler or vLLM): sample, score given tokens, load adapters.

Why: OPSD (and RL next) samples from the adapter being trained and scores tokens under another prompt,
and services never import each other, so the trainer speaks vLLM's OpenAI-compatible wire format:
``/v1/completions`` with token-id prompts (``logprobs``, ``return_token_ids``) to sample, the same with
``prompt_logprobs=0`` to score, and ``/v1/load_lora_adapter`` where no publisher is in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx

from services.common.errors import FanrouteError


class SamplerError(FanrouteError, RuntimeError):
    """The sampler refused a request, answered something unexpected, or could not be reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sample:
    """One sampled completion: its token ids, the sampler's logprob of each, the text and why it stopped."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str | None


class SamplerClient:
    """Talks to one sampler at ``base_url``; pass ``http`` to reuse (or fake) an httpx.Client."""

    def __init__(self, base_url: str, timeout_s: float = 120.0, *, http: httpx.Client | None = None,
                 max_prompts: int = 8) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self._owns_http = http is None
        self.max_prompts = max_prompts

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self.http.close()

    def sample(self, model: str, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
               seed: int | None = None) -> Sample:
        """One completion of ``prompt_ids`` by ``model`` with its token ids and raw logprobs."""
        body: dict[str, Any] = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                                "temperature": temperature, "logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        choice = self._choices(self._post("/v1/completions", body), 1)[0]
        ids, lps = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lps is None or len(ids) != len(lps):
            raise SamplerError(f"{self.base_url}: completion without matching token_ids and token_logprobs "
                               "(return_token_ids and logprobs are needed)")
        return Sample(tuple(int(t) for t in ids), tuple(float(x) for x in lps), choice.get("text", ""),
                      choice.get("finish_reason"))

    def score(self, model: str, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """For each sequence, ``model``'s logprob of every token from ``starts[i]`` on, given the tokens before.

        vLLM's ``prompt_logprobs``: entry ``t`` of a choice's list is ``{token id: {logprob, ...}}`` for
        prompt token ``t`` (None for the first), so the tokens after ``start`` are re-aligned by position.
        """
        if len(sequences) != len(starts):
            raise ValueError("one start per sequence")
        out: list[list[float]] = []
        for lo in range(0, len(sequences), self.max_prompts):
            chunk = [list(s) for s in sequences[lo:lo + self.max_prompts]]
            body = {"model": model, "prompt": chunk, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            choices = self._choices(self._post("/v1/completions", body), len(chunk))
            for ids, start, choice in zip(chunk, starts[lo:lo + self.max_prompts], choices):
                entries = choice.get("prompt_logprobs")
                if entries is None or len(entries) != len(ids) or start < 1:
                    raise SamplerError(f"{self.base_url}: prompt_logprobs missing or of the wrong length "
                                       f"({None if entries is None else len(entries)} for {len(ids)} tokens)")
                try:
                    out.append([float(entries[t][str(ids[t])]["logprob"]) for t in range(start, len(ids))])
                except (KeyError, TypeError) as exc:
                    raise SamplerError(f"{self.base_url}: prompt_logprobs do not name the scored token: {exc}") from exc
        return out

    def load_adapter(self, name: str, path: str) -> None:
        """vLLM's ``/v1/load_lora_adapter`` (the path must be readable by the sampler); a name already
        loaded is replaced in place."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})

    def unload_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``; an adapter the sampler no longer knows is not an error."""
        try:
            self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except SamplerError as exc:
            if exc.status != 404:
                raise

    # ------------------------------------------------------------------ plumbing

    def _choices(self, body: Any, n: int) -> list[dict[str, Any]]:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            raise SamplerError(f"{self.base_url}: expected {n} choices, got {body!r:.300}")
        return sorted(choices, key=lambda c: c.get("index", 0))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise SamplerError(f"POST {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if r.is_error:
            try:
                detail = r.json()
                reason = detail.get("reason") or detail.get("message") or r.text
            except ValueError:
                reason = r.text[:500]
            raise SamplerError(f"POST {self.base_url}{path}: HTTP {r.status_code}: {reason}", status=r.status_code)
        ctype = r.headers.get("content-type", "")
        return r.json() if ctype.startswith("application/json") else r.text
