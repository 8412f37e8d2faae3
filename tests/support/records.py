"""Small builders of valid messages, shared by tests."""

from __future__ import annotations

from datetime import UTC, datetime

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
from schemas.calibration import CalibrationRecord, ProviderAgreement, Review
from schemas.trace import Route

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def citation(url: str = "collection://med/1", rank: int = 1) -> Citation:
    return Citation(url=url, title="t", rank=rank, snippet="s", score=1.5)


def candidate(provider: str = "bm25-all", urls: tuple[str, ...] = ("collection://med/1",)) -> Candidate:
    cits = tuple(citation(u, i + 1) for i, u in enumerate(urls))
    return Candidate(provider=provider, answer="a", citations=cits, latency_ms=12.5, cost_usd=0.001)


def signals() -> Signals:
    return Signals(pairwise_overlap={"a|b": 0.5}, mean_overlap=0.5, min_overlap=0.5, contested=False,
                   contested_threshold=0.2, providers_ok=2, providers_failed=0)


def trace(trace_id: str = "t1", query: str = "what is a cell") -> Trace:
    return Trace(trace_id=trace_id, received_at=NOW, query=query, mode="fanout",
                 candidates=(candidate("a"), candidate("b")), signals=signals())


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
