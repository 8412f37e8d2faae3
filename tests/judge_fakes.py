"""A scripted judge backend and trace builders for judge tests."""

from __future__ import annotations

from schemas.trace import Candidate, Citation, Trace
from services.judge.base import (
    JudgeBackend,
    JudgeFailed,
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
)
from tests.factories import NOW, signals


class KeywordJudge(JudgeBackend):
    """Grades 3 when an answer mentions 'excellent', 1 when 'meh', else 0; records every request."""

    def __init__(self, model: str = "keyword-judge", fail: bool = False) -> None:
        self.identity = JudgeIdentity(kind="test", model=model)
        self.requests: list[JudgeRequest] = []
        self.fail = fail

    async def judge(self, request: JudgeRequest) -> JudgeResult:
        self.requests.append(request)
        if self.fail:
            raise JudgeFailed("backend said no three times: 500, 500, unparseable")
        grades = {c.letter: 3 if "excellent" in c.answer else 1 if "meh" in c.answer else 0
                  for c in request.candidates}
        tiers = [tuple(L for L in request.letters if grades[L] == g) for g in (3, 2, 1, 0)]
        return JudgeResult(grades, tuple(t for t in tiers if t))


def cand(provider: str, answer: str, urls: tuple[str, ...] = ("https://x.org/1",), error: str | None = None):
    answer = f"{answer} (see collection://med/12)" if answer else answer
    cits = () if error else tuple(Citation(url=u, title=f"{provider} result", rank=i + 1,
                                           snippet=f"text from {provider.upper()}")
                                  for i, u in enumerate(urls))
    return Candidate(provider=provider, answer="" if error else answer, citations=cits, latency_ms=5,
                     cost_usd=0, error=error, error_kind="timeout" if error else None)


def judged_trace(trace_id: str = "t-1", contested: bool = True) -> Trace:
    s = signals().model_copy(update={"contested": contested})
    return Trace(trace_id=trace_id, received_at=NOW, query="what is boundary layer transition",
                 mode="fanout", signals=s, candidates=(
                     cand("bm25-all", "an excellent answer"), cand("dense-all", "a meh answer"),
                     cand("eng-bm25", "an excellent answer too"), cand("lib-bm25", "", error="timeout")))
