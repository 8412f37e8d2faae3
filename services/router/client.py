"""Ask the router (the CPU sampler or vLLM, OpenAI-compatible) for an ordering of the providers.

The request is the conversation the student was trained on (:mod:`services.common.prompt`). Two
modes: ``score`` asks ``/v1/completions`` for the log-probability of each provider name as the
continuation of that prompt, in one call of K prompts (:mod:`services.router.scoring`);
``first-token`` asks for one token after the prompt with its alternatives, which decides between
names that start differently in one forward (names sharing a first token get a K-prompt call of
their own, only when they could win; the first call per adapter and provider set is a K-prompt call
that also learns the names' first tokens); ``generate`` asks ``/v1/chat/completions`` to write the
ordering greedily and parses it. One deadline; every way
this can fail is a :class:`RouterError` with a ``kind`` the gateway counts its fallbacks by.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from services.common.adapter_files import ADAPTER_SHA256_HEADER
from services.common.errors import FanrouteError
from services.common.prompt import router_messages
from services.router.modes import MODES, RouterMode
from services.router.parse import ParsedOrdering, UnparseableOrdering, parse_ordering
from services.router.rates import PublishedRates, Rates
from services.router.scoring import (
    FIRST_TOKEN_TOP,
    choice_top,
    ScoresUnreadable,
    decide,
    common_tokens,
    first_token_request,
    first_token_scores,
    groups_of,
    ids_request,
    name_groups,
    name_tokens,
    parse_scores,
    resolve_group,
    score_request,
    split_group,
    top_logprobs,
)

#: (model, provider set) pairs whose names' first tokens are remembered.
NAME_GROUPS_KEPT = 64


class RouterError(FanrouteError, RuntimeError):
    """The router gave no usable ordering; ``kind`` names how (and labels the fallback metric)."""

    kind = "router_error"

    def __init__(self, message: str, *, raw: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.raw = raw  # the reply text, when there was one (an unparseable answer)
        self.status = status  # the HTTP status, when the server answered at all


class RouterTimeout(RouterError, TimeoutError):
    """No answer within the router deadline."""

    kind = "router_timeout"


class RouterUnparseable(RouterError, ValueError):
    """An answer that names no known provider."""

    kind = "unparseable"


@dataclass(frozen=True)
class RouterAnswer:
    """The parsed ordering, the reply as written, how long asking took, and (scoring) each provider's
    summed log-probability."""

    parsed: ParsedOrdering
    raw: str
    latency_ms: float
    scores: dict[str, float] | None = None
    adapter_sha256: str | None = None  # the content the server says answered (its header; None from vLLM)
    rates: Rates | None = None  # the router's top-tier table (services/router/rates.py); None: first choice

    @property
    def ordering(self) -> tuple[str, ...]:
        return self.parsed.ordering


def chat_request(model: str, providers: Sequence[str], query: str, max_tokens: int) -> dict[str, Any]:
    """The chat-completions body: the training conversation's system and user turns, greedy."""
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": router_messages(providers, query)}


#: The adapter content the current :meth:`RouterClient.route` call's answers named (one per task).
_ANSWERED_BY: contextvars.ContextVar[str | None] = contextvars.ContextVar("router_answered_by", default=None)


class RouterClient:
    """One HTTP session to an OpenAI-compatible server; :meth:`route` asks it for one ordering."""

    def __init__(self, base_url: str, *, timeout_s: float = 2.0, max_tokens: int = 48,
                 api_key: str | None = None, mode: RouterMode = "generate", prompt_format: str = "chatml",
                 first_token_slack: float = 0.1, first_token_top: int = FIRST_TOKEN_TOP,
                 prompt_logprobs: bool = True, rates_from: str | None = None) -> None:
        if timeout_s <= 0 or max_tokens < 1:
            raise ValueError("timeout_s must be > 0 and max_tokens >= 1")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "score" and not prompt_logprobs:
            raise ValueError("score mode needs prompt_logprobs; use first-token where the server must not get them")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.mode = mode
        self.prompt_format = prompt_format
        self.first_token_slack = first_token_slack
        self.first_token_top = first_token_top
        self.prompt_logprobs = prompt_logprobs  # False: never ask for them (vLLM-CPU with LoRA dies on them)
        self._tokens: OrderedDict[tuple[str, tuple[str, ...]], dict[str, tuple[int, ...]]] = OrderedDict()
        self._learning: dict[tuple[str, tuple[str, ...]], asyncio.Future[dict[str, tuple[int, ...]]]] = {}
        self._groups: OrderedDict[tuple[str, tuple[str, ...]], dict[int, tuple[str, ...]]] = OrderedDict()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        # the publisher each version's top-tier table is pulled from (the top-tier decision); None: not asked
        self.rates = PublishedRates(rates_from, timeout_s=timeout_s * 5) if rates_from else None

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=256, limit_per_host=256))

    async def close(self) -> None:
        if self.rates is not None:
            await self.rates.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def prepare(self, model: str) -> None:
        """Pull ``model``'s top-tier table now (on a promotion), so the first routed request need not."""
        if self.rates is not None:
            await self.rates.get(model)

    async def __aenter__(self) -> RouterClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def route(self, model: str, providers: Sequence[str], query: str, *,
                    timeout_s: float | None = None) -> RouterAnswer:
        """The ordering ``model`` gives ``query``; :class:`RouterError` (or a subclass) when there is none.

        ``adapter_sha256`` is what the server's last answer to this call named as the adapter's content."""
        token = _ANSWERED_BY.set(None)
        t0 = time.perf_counter()
        try:
            answer = await self._route(model, providers, query, timeout_s)
            rates = None
            if self.rates is not None and answer.scores is not None:
                left = (self.timeout_s if timeout_s is None else timeout_s) - (time.perf_counter() - t0)
                rates = await self.rates.get(model, wait_s=max(left, 0.0))
            return dataclasses.replace(answer, adapter_sha256=_ANSWERED_BY.get(), rates=rates)
        finally:
            _ANSWERED_BY.reset(token)

    async def _route(self, model: str, providers: Sequence[str], query: str,
                     timeout_s: float | None) -> RouterAnswer:
        await self.start()
        assert self._session is not None
        budget = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        if self.mode == "first-token":
            try:
                async with asyncio.timeout(budget):
                    return await self._first_token(model, providers, query, t0)
            except TimeoutError:
                raise RouterTimeout(f"router {model} gave no answer within {budget:g}s") from None
        if self.mode == "score":
            path, payload = "/v1/completions", score_request(model, providers, query, prompt_format=self.prompt_format)
        else:
            path, payload = "/v1/chat/completions", chat_request(model, providers, query, self.max_tokens)
        try:
            async with asyncio.timeout(budget):
                status, body = await self._post(model, path, payload)
        except TimeoutError:
            raise RouterTimeout(f"router {model} gave no answer within {budget:g}s") from None
        latency_ms = (time.perf_counter() - t0) * 1000.0
        if self.mode == "score":
            return _scored(model, providers, status, body, latency_ms)
        raw = _content(model, status, body)
        try:
            parsed = parse_ordering(raw, providers)
        except UnparseableOrdering as exc:
            raise RouterUnparseable(str(exc), raw=raw) from exc
        return RouterAnswer(parsed, raw, round(latency_ms, 3))

    async def _post(self, model: str, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        assert self._session is not None
        try:
            async with self._session.post(f"{self.base_url}{path}", json=payload) as r:
                body = await r.read()
                if r.status == 200 and ADAPTER_SHA256_HEADER in r.headers:
                    _ANSWERED_BY.set(r.headers[ADAPTER_SHA256_HEADER])
                return r.status, body
        except aiohttp.ClientError as exc:
            raise RouterError(f"router {model} unreachable at {self.base_url}: {type(exc).__name__}: {exc}") from exc

    async def _exact_scores(self, model: str, providers: Sequence[str], names: Sequence[str], query: str,
                            prompt_tokens: int) -> dict[str, float]:
        """Each of ``names``' whole log-probability after the ``prompt_tokens``-token router prompt (one call)."""
        status, body = await self._post(model, "/v1/completions", score_request(
            model, providers, query, prompt_format=self.prompt_format, candidates=names))
        if status != 200:
            raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
        try:
            return parse_scores(json.loads(body), names, prompt_tokens=prompt_tokens)
        except (ValueError, AttributeError) as exc:
            raise RouterUnparseable(f"router {model}: no candidate scores: {exc}",
                                    raw=body[:300].decode(errors="replace")) from exc

    async def _completion(self, model: str, payload: dict[str, Any]) -> dict[str, Any]:
        status, body = await self._post(model, "/v1/completions", payload)
        if status != 200:
            raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
        try:
            return json.loads(body)
        except ValueError as exc:
            raise RouterUnparseable(f"router {model}: {exc}", raw=body[:300].decode(errors="replace")) from exc

    async def _learn_tokens(self, key: tuple[str, tuple[str, ...]], query: str,
                            prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """The names' token ids from one K-prompt call, made once however many decisions wait for it.

        A cold start under load would otherwise send every waiting decision's K prompts at once."""
        pending = self._learning.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_tokens(key, query, prompt_tokens))
            self._learning[key] = pending
            pending.add_done_callback(lambda done: (self._learning.pop(key, None),
                                                    done.cancelled() or done.exception()))
        return await asyncio.shield(pending)  # one waiter's timeout must not cancel the others' fetch

    async def _fetch_tokens(self, key: tuple[str, tuple[str, ...]], query: str,
                            prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        model, providers = key
        tokens = name_tokens(await self._completion(model, ids_request(
            model, providers, query, prompt_format=self.prompt_format)), providers, prompt_tokens)
        self._tokens[key] = tokens
        while len(self._tokens) > NAME_GROUPS_KEPT:
            self._tokens.popitem(last=False)
        return tokens

    async def _first_token_ids(self, model: str, providers: Sequence[str], query: str, t0: float) -> RouterAnswer:
        """The first-token decision without ``prompt_logprobs``: the names' tokens come from a tokenizing
        K-prompt call (once per adapter and provider set); a shared first token is split by the token after
        the names' common prefix, asked in the same call (a second prompt: the router prompt + that prefix,
        one forward for both) and, where its tokens do not come out as the prompt's plus the prefix's, by
        one more one-token completion of the token ids."""
        key = (model, tuple(providers))
        known = self._tokens.get(key)
        request = {**first_token_request(model, providers, query, prompt_format=self.prompt_format,
                                         top=self.first_token_top), "return_token_ids": True}
        shared = [g for g in groups_of(known).values() if len(g) > 1] if known else []
        if shared:  # the text every member starts with; its token ids are checked on the answer
            request["prompt"] = [request["prompt"], *(request["prompt"] + os.path.commonprefix(g) for g in shared)]
        data = await self._completion(model, request)
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            top = choice_top(choices[0])
            prompt_ids = [int(t) for t in choices[0]["prompt_token_ids"]]
            tokens = known or await self._learn_tokens(key, query, len(prompt_ids))
            branches = {g: c for g, c in zip(shared, choices[1:])
                        if [int(t) for t in c["prompt_token_ids"]] == prompt_ids + common_tokens(g, tokens)}
            groups = groups_of(tokens)
            found = first_token_scores(top, groups, self.first_token_slack)
            if found is None:  # no name's first token is listed: all are bounded by the least listed one
                floor = min(top.values())
                found = ({n: floor - math.log(len(g)) for g in groups.values() for n in g}, [])
            scores, unresolved = found
            for group in unresolved:
                if group in branches:
                    after = choice_top(branches[group])
                else:
                    after = top_logprobs(await self._completion(model, {
                        "model": model, "prompt": prompt_ids + common_tokens(group, tokens), "max_tokens": 1,
                        "temperature": 0.0, "logprobs": self.first_token_top, "return_tokens_as_token_ids": True}))[0]
                scores.update(split_group(top[tokens[group[0]][0]], group, tokens, after))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise RouterUnparseable(f"router {model}: {exc}") from exc
        parsed = ParsedOrdering(tiers=tuple((n,) for n in decide(scores, {}, 0.0)), unknown=(), missing=())
        return RouterAnswer(parsed, "", round((time.perf_counter() - t0) * 1000.0, 3),
                            scores={n: round(s, 6) for n, s in scores.items()})

    async def _first_token(self, model: str, providers: Sequence[str], query: str, t0: float) -> RouterAnswer:
        """The first-token decision (module docstring); the K-prompt answer when it cannot be made."""
        if not self.prompt_logprobs:
            return await self._first_token_ids(model, providers, query, t0)
        status, body = await self._post(model, "/v1/completions", first_token_request(
            model, providers, query, prompt_format=self.prompt_format, top=self.first_token_top))
        if status != 200:
            raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
        try:
            top, prompt_tokens = top_logprobs(json.loads(body))
        except ValueError as exc:
            raise RouterUnparseable(f"router {model}: {exc}", raw=body[:300].decode(errors="replace")) from exc
        key = (model, tuple(providers))
        groups = self._groups.get(key)
        found = first_token_scores(top, groups, self.first_token_slack) if groups is not None else None
        if found is None:  # names not learned yet (or the best name's first token unlisted): K prompts
            status, kbody = await self._post(model, "/v1/completions",
                                             score_request(model, providers, query, prompt_format=self.prompt_format))
            answer = _scored(model, providers, status, kbody, 0.0)
            if groups is None:
                try:
                    self._groups[key] = name_groups(json.loads(kbody), providers, prompt_tokens)
                except (ValueError, KeyError, TypeError) as exc:
                    raise RouterUnparseable(f"router {model}: {exc}") from exc
                while len(self._groups) > NAME_GROUPS_KEPT:
                    self._groups.popitem(last=False)
            scores = answer.scores or {}
        else:
            scores, unresolved = found
            for group in unresolved:
                resolve_group(scores, await self._exact_scores(model, providers, group, query, prompt_tokens))
        parsed = ParsedOrdering(tiers=tuple((n,) for n in decide(scores, {}, 0.0)), unknown=(), missing=())
        return RouterAnswer(parsed, "", round((time.perf_counter() - t0) * 1000.0, 3),
                            scores={n: round(s, 6) for n, s in scores.items()})


def _scored(model: str, providers: Sequence[str], status: int, body: bytes, latency_ms: float) -> RouterAnswer:
    """The answer of a scoring call: providers by probability (cost is the gateway's to weigh)."""
    if status != 200:
        raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
    try:
        scores = parse_scores(json.loads(body), providers)
    except (ValueError, AttributeError) as exc:  # ScoresUnreadable is a ValueError, so is bad JSON
        why = str(exc) if isinstance(exc, ScoresUnreadable) else f"not JSON ({exc})"
        raise RouterUnparseable(f"router {model}: no candidate scores: {why}",
                                raw=body[:300].decode(errors="replace")) from exc
    parsed = ParsedOrdering(tiers=tuple((n,) for n in decide(scores, {}, 0.0)), unknown=(), missing=())
    return RouterAnswer(parsed, "", round(latency_ms, 3), scores={n: round(s, 6) for n, s in scores.items()})


def _content(model: str, status: int, body: bytes) -> str:
    """The first choice's message text, or a RouterError that says what came back instead."""
    if status != 200:
        raise RouterError(f"router {model}: HTTP {status}: {error_reason(body)}", status=status)
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RouterError(f"router {model}: not a chat completion ({type(exc).__name__}): "
                          f"{body[:200].decode(errors='replace')}", status=status) from exc
    if not isinstance(content, str):
        raise RouterError(f"router {model}: message content is {type(content).__name__}, not text", status=status)
    return content


def error_reason(body: bytes) -> str:
    """The text of an OpenAI/vLLM (``error.message`` or ``message``) or fanroute (``reason``) error body."""
    try:
        data = json.loads(body)
        err = data.get("error")
        text = err.get("message") if isinstance(err, dict) else data.get("reason") or data.get("message") or err
    except (ValueError, AttributeError):
        text = None
    return str(text) if text else body[:300].decode(errors="replace")
