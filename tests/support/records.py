"""Builders of valid records for tests: citations, candidates, traces (plain, judged, over ADI),
verdicts and episodes, and one valid instance of every topic message."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from functools import lru_cache

from schemas import (
    AdapterPublished,
    Candidate,
    CandidateGrade,
    ChatMessage,
    Citation,
    Episode,
    RewardComponent,
    Signals,
    Task,
    Trace,
    Verdict,
)
from schemas.base import content_id
from schemas.calibration import CalibrationRecord, ProviderAgreement, Review
from schemas.trace import Route
from services.common.prompt import system_prompt
from services.providers.collections import (
    Doc,
    default_collections_dir,
    load_corpus,
    load_qrels,
    load_queries,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
# the grades a keyword judge gives judged_trace()'s candidates (and verdict_for()'s default)
GRADES = {"bm25-all": 3, "dense-all": 1, "eng-bm25": 3, "lib-bm25": 0}


def citation(url: str = "collection://med/1", rank: int = 1, *, title: str = "t", snippet: str = "s",
             score: float | None = 1.5) -> Citation:
    return Citation(url=url, title=title, rank=rank, snippet=snippet, score=score)


def candidate(provider: str = "bm25-all", urls: Sequence[str] = ("collection://med/1",), *, answer: str = "a",
              texts: Sequence[tuple[str, str]] = (), cost: float = 0.001, latency: float = 12.5,
              error: str | None = None, score: float | None = 1.5) -> Candidate:
    """A candidate citing ``urls`` (titles and snippets from ``texts`` where given); ``error`` makes it a
    failed one (a timeout: no answer, no citations, no cost)."""
    if error:
        return Candidate(provider=provider, latency_ms=latency, cost_usd=0.0, error=error, error_kind="timeout")

    def cit(i: int, url: str) -> Citation:
        title, snippet = texts[i] if i < len(texts) else ("t", "s")
        return citation(url, i + 1, title=title, snippet=snippet, score=score)

    return Candidate(provider=provider, answer=answer, citations=tuple(cit(i, u) for i, u in enumerate(urls)),
                     latency_ms=latency, cost_usd=cost)


def signals() -> Signals:
    return Signals(pairwise_overlap={"a|b": 0.5}, mean_overlap=0.5, min_overlap=0.5, contested=False,
                   contested_threshold=0.2, providers_ok=2, providers_failed=0)


def trace(trace_id: str = "t1", candidates: Sequence[Candidate] | None = None, *, query: str = "what is a cell",
          query_id: str | None = None, mode: str = "fanout", contested: bool = False) -> Trace:
    """A trace of ``candidates`` (two that agree by default); a ``routed`` one called the first of them."""
    cands = tuple(candidates) if candidates is not None else (candidate("a"), candidate("b"))
    routed = {}
    if mode == "routed":
        routed = {"router_version": "router@1", "route": Route(router="router@1", called=(cands[0].provider,))}
    return Trace(trace_id=trace_id, received_at=NOW, query=query, query_id=query_id, mode=mode, candidates=cands,
                 signals=signals().model_copy(update={"contested": contested}), **routed)


def judged_trace(trace_id: str = "t-1", contested: bool = True) -> Trace:
    """Four providers as a keyword judge grades them (:data:`GRADES`): bm25-all and eng-bm25 "excellent",
    dense-all "meh", lib-bm25 timed out."""

    def cand(provider: str, answer: str, error: str | None = None) -> Candidate:
        return candidate(provider, ("https://x.org/1",), answer=f"{answer} (see collection://med/12)",
                         texts=[(f"{provider} result", f"text from {provider.upper()}")], cost=0, latency=5,
                         error=error, score=None)

    return trace(trace_id, (cand("bm25-all", "an excellent answer"), cand("dense-all", "a meh answer"),
                            cand("eng-bm25", "an excellent answer too"), cand("lib-bm25", "", error="timeout")),
                 query="what is boundary layer transition", contested=contested)


def verdict_for(trace_id: str, *, model: str = "judge-a", rubric: str = "rubric-1",
                grades: dict[str, int] | None = None, status: str = "ok") -> Verdict:
    """A verdict on ``trace_id`` whose ordering follows ``grades`` (ties share a tier)."""
    grades = grades or GRADES
    tiers = [tuple(sorted(p for p, g in grades.items() if g == level)) for level in (3, 2, 1, 0)]
    return Verdict(verdict_id=content_id("v", trace_id, model, rubric), trace_id=trace_id, judged_at=NOW,
                   judge_kind="test", judge_model=model, rubric_version="r", rubric_hash=rubric,
                   status=status, sampled_because="contested",
                   grades=tuple(CandidateGrade(provider=p, grade=g) for p, g in sorted(grades.items())),
                   ordering=tuple(t for t in tiers if t) if status == "ok" else ())


def episode(query: str, ordering: str, providers: Sequence[str], ep_id: str | None = None, *,
            trace_id: str | None = None, created_at: datetime = NOW,
            rewards: Sequence[RewardComponent] = ()) -> Episode:
    """A routing episode: the system turn names ``providers``, the assistant turn is ``ordering``."""
    return Episode(episode_id=ep_id or f"e-{abs(hash(query)) % 10**8}", trace_id=trace_id, created_at=created_at,
                   messages=(ChatMessage(role="system", content=system_prompt(providers)),
                             ChatMessage(role="user", content=query),
                             ChatMessage(role="assistant", content=ordering)),
                   rewards=tuple(rewards))


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

    def cand(provider: str, ids: list[str], cost: float, latency: float, error: str | None = None) -> Candidate:
        return candidate(provider, [f"collection://adi/{i}" for i in ids], answer="answer", cost=cost,
                         latency=latency, texts=[(docs[i].title, docs[i].text[:300]) for i in ids], error=error,
                         score=None)

    cands = [cand("good", rel, good_cost, 300.0), cand("cheap", irrelevant, cheap_cost, 50.0),
             cand("flaky", rel[:1], 0.002, 80.0, "no answer within 1s" if flaky_error else None)]
    return trace(trace_id or f"adi-{qid}", cands, query=queries[qid], query_id=f"adi/{qid}")


def all_examples() -> list:
    """One valid instance of every topic message and every nested model."""
    return [
        citation(), candidate(), signals(), trace(),
        Trace(trace_id="t2", received_at=NOW, query="q", mode="routed", router_version="router@3",
              route=Route(router="router@3", ordering=("a", "b"), called=("a",), router_ms=12.5),
              candidates=(Candidate(provider="a", latency_ms=3, cost_usd=0, error="boom",
                                    error_kind="timeout"),), signals=signals()),
        Verdict(verdict_id="v1", trace_id="t1", judged_at=NOW, judge_kind="local", judge_model="m",
                rubric_version="r1", rubric_hash="h", letters={"A": "a"},
                status="ok", sampled_because="contested",
                grades=(CandidateGrade(provider="a", letter="A", grade=3),),
                ordering=(("a",), ("b", "c"))),
        Episode(episode_id="e1", trace_id="t1", created_at=NOW,
                messages=(ChatMessage(role="system", content="s"), ChatMessage(role="user", content="q"),
                          ChatMessage(role="assistant", content="a > b = c")),
                rewards=(RewardComponent(component_id="c1", name="ndcg", value=0.9),)),
        Task(task_id="k1", trace_id="t1", created_at=NOW, files={"task.toml": "x"}),
        CalibrationRecord(gate_key="g", created_at=NOW, judge_kind="local", judge_model="m",
                          rubric_hash="h", providers=("a", "b"), human_source="qrels", tau_b=0.5,
                          top1=0.6, n=10, threshold=0.7, open=False,
                          per_provider={"a": ProviderAgreement(tau_b=None, top1=0.5, n=4)}),
        Review(review_id="r", verdict_id="v1", reviewer="ana", mark="agree", created_at=NOW),
        AdapterPublished(model_id="router", version=1, base_model="smollm2", url="http://x/a",
                         files_sha256={"adapter_model.safetensors": "ab"}, published_at=NOW),
    ]
