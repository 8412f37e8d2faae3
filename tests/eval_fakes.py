"""Builders shared by the eval/promote tests (no tests here): traces over a real collection, training
episodes, and a fake OpenAI-compatible router server."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import lru_cache

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from schemas.episode import ChatMessage, Episode
from schemas.trace import Candidate, Citation, Trace
from services.common.prompt import system_prompt
from services.providers.collections import (
    Doc,
    default_collections_dir,
    load_corpus,
    load_qrels,
    load_queries,
)
from tests.factories import NOW, signals
from tests.http_fake import LoopbackServer


def cand(provider: str, urls: Sequence[str] = ("https://x.org/1",), *, cost: float = 0.001,
         latency: float = 100.0, error: str | None = None, texts: Sequence[tuple[str, str]] = ()) -> Candidate:
    """A candidate citing ``urls`` (titles/snippets from ``texts`` when given); ``error`` makes it a failure."""
    if error:
        return Candidate(provider=provider, latency_ms=latency, cost_usd=0.0, error=error, error_kind="timeout")
    cits = tuple(Citation(url=u, rank=i + 1, title=texts[i][0] if i < len(texts) else f"doc {i}",
                          snippet=texts[i][1] if i < len(texts) else "")
                 for i, u in enumerate(urls))
    return Candidate(provider=provider, answer="answer", citations=cits, latency_ms=latency, cost_usd=cost)


def make_trace(trace_id: str, cands: Sequence[Candidate], *, query: str = "what is a cell",
               query_id: str | None = None, mode: str = "fanout") -> Trace:
    extra = {}
    if mode == "routed":
        from schemas.trace import Route as TraceRoute

        extra = {"router_version": "router@1", "route": TraceRoute(router="router@1", called=(cands[0].provider,))}
    return Trace(trace_id=trace_id, received_at=NOW, query=query, query_id=query_id, mode=mode,
                 candidates=tuple(cands), signals=signals(), **extra)


def episode(query: str, ordering: str, providers: Sequence[str], ep_id: str | None = None) -> Episode:
    """A training episode: the system turn names ``providers``, the assistant turn is ``ordering``."""
    return Episode(episode_id=ep_id or f"e-{abs(hash(query)) % 10**8}", created_at=NOW,
                   messages=(ChatMessage(role="system", content=system_prompt(providers)),
                             ChatMessage(role="user", content=query),
                             ChatMessage(role="assistant", content=ordering)))


def write_jsonl(path, items) -> None:
    path.write_bytes(b"".join(x.to_bytes() + b"\n" for x in items))


@lru_cache(maxsize=1)
def adi() -> tuple[dict[str, str], dict[str, dict[str, int]], dict[str, Doc]]:
    """ADI's queries (id → text), qrels and documents (id → Doc)."""
    d = default_collections_dir()
    return ({q.query_id: q.text for q in load_queries(d, "adi")}, load_qrels(d, "adi"),
            {doc.doc_id: doc for doc in load_corpus(d, "adi")})


def adi_trace(qid: str, *, good_cost: float = 0.004, cheap_cost: float = 0.001, flaky_error: bool = False,
              trace_id: str | None = None) -> Trace:
    """A fan-out trace of ADI query ``qid``: ``good`` cites its relevant documents, ``cheap`` irrelevant
    ones, ``flaky`` the relevant ones too but (``flaky_error``) may have failed."""
    queries, qrels, docs = adi()
    rel = sorted(qrels[qid])
    irrelevant = [d for d in sorted(docs, key=int) if d not in qrels[qid]][:5]

    def texts(ids):
        return [(docs[i].title, docs[i].text[:300]) for i in ids]

    def urls(ids):
        return [f"collection://adi/{i}" for i in ids]

    cands = [cand("good", urls(rel), cost=good_cost, latency=300.0, texts=texts(rel)),
             cand("cheap", urls(irrelevant), cost=cheap_cost, latency=50.0, texts=texts(irrelevant)),
             cand("flaky", urls(rel[:1]), cost=0.002, latency=80.0, texts=texts(rel[:1]),
                  error="no answer within 1s" if flaky_error else None)]
    return make_trace(trace_id or f"adi-{qid}", cands, query=queries[qid], query_id=f"adi/{qid}")


Answer = Callable[[str, str], str | None]


def router_app(answer: Answer, models: Sequence[str]) -> Starlette:
    """``POST /v1/chat/completions``: ``answer(model, query)`` as the content; 404 for other models;
    an ``answer`` of None is a 500."""

    async def chat(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        model = body["model"]
        if model not in models:
            return JSONResponse({"error": "model_not_found", "reason": f"The model `{model}` does not exist.",
                                 "object": "error", "message": f"The model `{model}` does not exist."}, 404)
        query = next(m["content"] for m in body["messages"] if m["role"] == "user")
        text = answer(model, query)
        if text is None:
            return JSONResponse({"error": "internal", "reason": "boom"}, 500)
        return JSONResponse({"id": "c", "object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def router_server(answer: Answer, models: Sequence[str]) -> LoopbackServer:
    return LoopbackServer(router_app(answer, models), name="fake-router")
