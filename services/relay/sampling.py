"""The relay's client of the sampler's raw completions endpoint (the CPU sampler or vLLM): token ids in,
sampled token ids and their logprobs out (``return_token_ids``, ``logprobs``), nothing re-tokenized."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from services.common.adapter_files import ADAPTER_SHA256_HEADER
from services.relay.conversation import BadRequest, Sampling


class SamplerUnavailable(Exception):
    """The sampler did not answer, or answered with a 5xx: a 503 to the harness (retry)."""

    status, kind = 503, "sampler_unavailable"


class SamplerUnusable(SamplerUnavailable):
    """The sampler answered, but not something the relay can use (a 4xx that is not about the request,
    no model listed, token ids without logprobs): a 502 to the harness."""

    status, kind = 502, "sampler_unusable"


@dataclass(frozen=True)
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    top_logprobs: list[dict[str, float]] | None
    adapter_sha256: str | None = None  # the adapter content the sampler named (None: the base, or vLLM)


def completion_body(model: str, prompt_ids: list[int], s: Sampling, *, stream: bool = False) -> dict[str, Any]:
    """The ``/v1/completions`` body: the prompt as token ids, the sampled ids and logprobs asked back."""
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": s.max_tokens,
                            "logprobs": s.top_logprobs or 0, "return_token_ids": True, "stream": stream}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(s, name) is not None:
            body[name] = getattr(s, name)
    if s.stop:
        body["stop"] = list(s.stop)
    return body


class SamplerClient:
    """One pooled HTTP client to the sampler."""

    def __init__(self, base_url: str, timeout_s: float, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport)
        self.calls = 0  # completions requests sent (tests check that refusals send none)

    async def close(self) -> None:
        await self.client.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = await self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise SamplerUnavailable(f"the sampler at {self.client.base_url} did not answer: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500:
            raise SamplerUnavailable(f"the sampler answered {r.status_code}: {r.text[:500]}")
        return r

    async def model_ids(self) -> list[str]:
        r = await self._request("GET", "/v1/models")
        if r.status_code != 200:
            raise SamplerUnusable(f"the sampler's /v1/models answered {r.status_code}: {r.text[:500]}")
        try:
            return [m["id"] for m in r.json().get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            raise SamplerUnusable(f"the sampler's /v1/models answered no model list: {r.text[:500]}") from exc

    async def complete(self, model: str, prompt_ids: list[int], s: Sampling) -> Sampled:
        self.calls += 1
        r = await self._request("POST", "/v1/completions", json=completion_body(model, prompt_ids, s))
        if r.status_code != 200:
            raise _refusal(r.status_code, r.text)
        try:
            choice = r.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SamplerUnusable(f"the sampler's completion is not vLLM's shape: {r.text[:500]}") from exc
        return _sampled([choice], s, r.headers.get(ADAPTER_SHA256_HEADER), r.text)

    async def stream(self, model: str, prompt_ids: list[int], s: Sampling) -> AsyncIterator[str | Sampled]:
        """The completion as the sampler decodes it: each text piece, then the whole :class:`Sampled`
        (token ids and logprobs joined from every chunk). A sampler that answers JSON instead of events
        (one that does not stream) gives its whole text as one piece."""
        self.calls += 1
        body = completion_body(model, prompt_ids, s, stream=True)
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")
                    if r.status_code >= 500:
                        raise SamplerUnavailable(f"the sampler answered {r.status_code}: {text[:500]}")
                    raise _refusal(r.status_code, text)
                digest = r.headers.get(ADAPTER_SHA256_HEADER)
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    raw = (await r.aread()).decode("utf-8", "replace")
                    try:
                        whole = _sampled([json.loads(raw)["choices"][0]], s, digest, raw)
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        raise SamplerUnusable(f"the sampler's completion is not vLLM's shape: {raw[:500]}") from exc
                    if whole.text:
                        yield whole.text
                    yield whole
                    return
                chunks: list[dict[str, Any]] = []
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    choice = _chunk_choice(data)
                    chunks.append(choice)
                    if choice.get("text"):
                        yield choice["text"]
        except httpx.HTTPError as exc:
            raise SamplerUnavailable(f"the sampler's stream at {self.client.base_url} broke: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if not chunks or chunks[-1].get("finish_reason") is None:
            raise SamplerUnavailable("the sampler's stream ended before its last chunk (no finish_reason)")
        yield _sampled(chunks, s, digest, f"{len(chunks)} streamed chunks")


def _refusal(status: int, text: str) -> Exception:
    """A non-200, non-5xx answer: the harness's request refused, or the relay's setup wrong."""
    try:
        data = json.loads(text)
        reason = data.get("reason") or data.get("message") or (data.get("error") or {}).get("message")
    except (ValueError, AttributeError):
        reason = None
    if status in (400, 413, 422):  # the sampler refused this request (prompt too long, ...)
        return BadRequest(f"the sampler refused the call: {reason or text[:500]}", None, kind="sampler_refused")
    # 404 (no such model or adapter), 401, ...: the relay's setup, not the harness's request
    return SamplerUnusable(f"the sampler answered {status}: {reason or text[:500]}")


def _chunk_choice(data: str) -> dict[str, Any]:
    """One streamed chunk's choice; a chunk that says the generation failed is the sampler's failure."""
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise SamplerUnusable(f"the sampler streamed something that is not JSON: {data[:500]}") from exc
    if isinstance(chunk, dict) and chunk.get("error"):
        err = chunk["error"]
        raise SamplerUnavailable(f"the sampler's generation failed mid-stream: "
                                 f"{err.get('message') if isinstance(err, dict) else err}")
    try:
        choice = chunk["choices"][0]
        assert isinstance(choice, dict)
    except (KeyError, IndexError, TypeError, AssertionError) as exc:
        raise SamplerUnusable(f"the sampler's chunk is not vLLM's shape: {data[:500]}") from exc
    return choice


def _sampled(choices: list[dict[str, Any]], s: Sampling, digest: str | None, shown: str) -> Sampled:
    """One completion from its choice, or from the choices of its streamed chunks, in order."""
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    try:
        for choice in choices:
            lp = choice.get("logprobs") or {}
            ids += [int(i) for i in choice.get("token_ids") or []]
            logprobs += [float(x) for x in lp.get("token_logprobs") or []]
            tops += list(lp.get("top_logprobs") or [])
    except (ValueError, TypeError, AttributeError) as exc:
        raise SamplerUnusable(f"the sampler's completion is not vLLM's shape: {shown[:500]}") from exc
    if len(logprobs) != len(ids):
        raise SamplerUnusable(f"the sampler returned {len(ids)} token ids but {len(logprobs)} logprobs "
                              "(does it support return_token_ids?)")
    last = choices[-1]
    return Sampled(token_ids=ids, logprobs=logprobs, text="".join(c.get("text") or "" for c in choices),
                   finish_reason=last.get("finish_reason") or "length", stop_reason=last.get("stop_reason"),
                   top_logprobs=tops if s.top_logprobs is not None else None, adapter_sha256=digest)
