"""From a request to the engine and back: sampling parameters, prompts, and vLLM's response bodies.

``create_completion`` and ``create_chat_completion`` turn a validated request into generations
and shape them as vLLM's ``CompletionResponse`` and ``ChatCompletionResponse`` (logprobs,
token ids, usage); ``model_cards`` is vLLM's ``ModelList``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services.sampler.engine import Engine, Generation, PromptError, SamplingParams
from services.sampler.registry import AdapterEntry
from services.sampler.scoring import Scored
from services.sampler.serving import Sampler
from services.sampler.settings import SamplerSettings
from services.sampler.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    bad_request,
)

Plan = tuple[list[int], SamplingParams]  # one prompt's token ids and how to sample after it
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this so the JSON stays valid


def sampling_params(req: SamplingFields, settings: SamplerSettings, max_tokens: int,
                    logprobs: int | None) -> SamplingParams:
    """vLLM's defaults for what the request leaves out; refuses what this server does not serve."""
    if logprobs is not None and logprobs > settings.max_logprobs:
        raise bad_request(f"logprobs: {logprobs} is over the limit of {settings.max_logprobs}", "logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > settings.max_stop_strings or any(not s for s in stop):
        raise bad_request(f"stop: at most {settings.max_stop_strings} non-empty strings", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=req.top_k or 0, seed=req.seed, stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)


def _token_name(engine: Engine, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else engine.token_text(token_id)


def completion_logprobs(engine: Engine, gen: Generation, as_ids: bool, offset: int = 0) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs``: tokens, token_logprobs, top_logprobs (sampled + top-k), text_offset
    (counted from ``offset``: where a streamed chunk's first token starts)."""
    tokens = [_token_name(engine, t, as_ids) for t in gen.token_ids]
    offsets, at = [], offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"text_offset": offsets,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in gen.logprobs],
            "tokens": tokens,
            "top_logprobs": [{_token_name(engine, i, as_ids): max(lp, LOGPROB_FLOOR) for i, lp in step}
                             for step in gen.top_logprobs]}


def chat_logprobs(engine: Engine, gen: Generation, k: int, as_ids: bool) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs``: one entry per sampled token with ``k`` alternatives."""

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        name = _token_name(engine, token_id, as_ids)
        return {"token": name, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(name.encode("utf-8", "replace"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in step[:k]]}
                        for t, lp, step in zip(gen.token_ids, gen.logprobs, gen.top_logprobs)]}


def prompt_logprobs(engine: Engine, scored: Scored) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``PromptLogprobs``: None for the first token, then ``{token_id: Logprob}`` per position
    (the actual token first, with its vocabulary rank; then the top-k with ranks 1..k)."""
    return [None if entry is None else
            {str(t): {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": engine.token_text(t)}
             for t, lp, rank in entry}
            for entry in scored.prompt_logprobs]


def check_prompt_logprobs(k: int | None, settings: SamplerSettings) -> None:
    """vLLM's bounds: a count from 0 to max_logprobs (its -1, the whole vocabulary, is not served)."""
    if k is None:
        return
    if k < 0:
        raise bad_request(f"prompt_logprobs: must be >= 0, got {k} (-1, the whole vocabulary, is not served)",
                          "prompt_logprobs")
    if k > settings.max_logprobs:
        raise bad_request(f"prompt_logprobs: requested {k}, which is greater than the max allowed "
                          f"{settings.max_logprobs}", "prompt_logprobs")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompts(req: CompletionRequest, engine: Engine, max_prompts: int) -> list[list[int]]:
    """The request's prompts as token-id lists (text is tokenized like vLLM does)."""
    p = req.prompt
    if isinstance(p, str):
        batch: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        batch = [p]  # type: ignore[list-item]
    else:
        batch = list(p)  # type: ignore[arg-type]
    if not batch:
        raise bad_request("prompt: must not be empty", "prompt")
    if len(batch) > max_prompts:
        raise bad_request(f"prompt: {len(batch)} prompts; at most {max_prompts} per request", "prompt")
    out = []
    for item in batch:
        if isinstance(item, str) and not item:
            raise bad_request("prompt: must not be empty", "prompt")
        out.append(engine.encode(item) if isinstance(item, str) else list(item))
    return out


async def plan_completion(s: Sampler, req: CompletionRequest) -> tuple[AdapterEntry | None, list[Plan]]:
    """Everything a completion is refused for, checked before anything is generated (or streamed):
    the adapter to use and, per prompt, its token ids and sampling parameters."""
    if req.echo:
        raise bad_request("echo: echoing the prompt is not served by the CPU sampler", "echo")
    check_prompt_logprobs(req.prompt_logprobs, s.settings)
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("stream: prompt_logprobs are not streamed by the CPU sampler (ask without stream)",
                          "stream")
    entry = await s.resolve(req.model)
    prompts = _prompts(req, s.eng, s.settings.max_prompts)
    max_tokens = req.max_tokens if req.max_tokens is not None else s.settings.default_max_tokens
    return entry, [(ids, sampling_params(req, s.settings, s.check_prompt(ids, max_tokens, "prompt"), req.logprobs))
                   for ids in prompts]


async def create_completion(s: Sampler, req: CompletionRequest) -> dict[str, Any]:
    """``/v1/completions`` → vLLM's ``CompletionResponse`` (one choice per prompt)."""
    entry, plans = await plan_completion(s, req)
    max_tokens = req.max_tokens if req.max_tokens is not None else s.settings.default_max_tokens
    if req.prompt_logprobs is None and max_tokens != 1:
        gens = await asyncio.gather(*(s.generate(entry, ids, params) for ids, params in plans))
        done = [(None, gen) for gen in gens]  # decoded together
    else:  # one scoring pass for every prompt (batched with concurrent requests), then the tokens
        done = await s.score(entry, [ids for ids, _ in plans], req.prompt_logprobs, [p for _, p in plans])
        if req.prompt_logprobs is None:  # a one-token completion: the prefix cache serves it, as vLLM's does
            done = [(None, gen) for _, gen in done]
    choices, n_prompt, n_completion = [], 0, 0
    for index, (scored, gen) in enumerate(done):
        choices.append({
            "index": index, "text": gen.text,
            "logprobs": completion_logprobs(s.eng, gen, bool(req.return_tokens_as_token_ids))
            if req.logprobs is not None else None,
            "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason,
            "token_ids": gen.token_ids if req.return_token_ids else None,
            "prompt_logprobs": prompt_logprobs(s.eng, scored) if scored is not None else None,
            "prompt_token_ids": gen.prompt_token_ids if req.return_token_ids else None})
        n_prompt, n_completion = n_prompt + len(gen.prompt_token_ids), n_completion + len(gen.token_ids)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or s.model_name, "choices": choices, "usage": _usage(n_prompt, n_completion)}


async def plan_chat(s: Sampler, req: ChatCompletionRequest) -> tuple[AdapterEntry | None, Plan, int | None]:
    """What a chat completion is refused for, checked first: the adapter, the prompt and its sampling
    parameters, and how many alternatives per token to report (None: no logprobs)."""
    entry = await s.resolve(req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = s.eng.chat_prompt(messages)
    except PromptError as exc:
        raise bad_request(str(exc), "messages") from exc
    except Exception as exc:  # a template may raise on roles or orders it does not support
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from exc
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    for field in ("max_tokens", "max_completion_tokens"):  # the one not used is held to the limit too
        value = getattr(req, field)
        if value is not None and value > s.settings.max_tokens_limit:
            raise bad_request(f"{field}: {value} is over this server's limit of {s.settings.max_tokens_limit}",
                              field)
    max_tokens = s.check_prompt(ids, req.max_completion_tokens or req.max_tokens, "messages")
    return entry, (ids, sampling_params(req, s.settings, max_tokens, k)), k


async def create_chat_completion(s: Sampler, req: ChatCompletionRequest) -> dict[str, Any]:
    """``/v1/chat/completions`` → vLLM's ``ChatCompletionResponse``."""
    entry, (ids, params), k = await plan_chat(s, req)
    gen = await s.generate(entry, ids, params)
    choice = {"index": 0, "message": {"role": "assistant", "content": gen.text},
              "logprobs": chat_logprobs(s.eng, gen, k, bool(req.return_tokens_as_token_ids)) if k is not None
              else None,
              "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason,
              "token_ids": gen.token_ids if req.return_token_ids else None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or s.model_name, "choices": [choice],
            "usage": _usage(len(ids), len(gen.token_ids)),
            "prompt_logprobs": None, "prompt_token_ids": ids if req.return_token_ids else None}


def model_cards(s: Sampler) -> dict[str, Any]:
    """vLLM's ``ModelList``: the base, then every adapter (``parent`` = the base), then the aliases."""
    now = int(time.time())

    def card(model_id: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": now, "owned_by": "fanroute", "root": root,
                "parent": parent, "max_model_len": max_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}

    data = [card(s.model_name, s.settings.base_model, None, s.eng.max_model_len)]
    data += [card(e.name, str(e.path), s.model_name, None) for e in s.registry.entries()]
    for alias, target in s.registry.aliases().items():
        if s.registry.get(alias) is None and (e := s.registry.get(target)) is not None:
            data.append(card(alias, str(e.path), s.model_name, None))
    return {"object": "list", "data": data}
