"""Fake providers and a scripted judge backend for fast unit tests (the real ones are tested on their own)."""

from __future__ import annotations

import asyncio

from schemas.trace import Citation
from services.common.errors import ProviderError
from services.judge.base import (
    JudgeBackend,
    JudgeFailed,
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
)
from services.providers.base import Provider, ProviderAnswer, build_answer


class StaticProvider(Provider):
    """Answers every query with fixed URLs after ``delay_s``, or raises ``error``."""

    def __init__(self, name: str, urls: tuple[str, ...] = (), *, delay_s: float = 0.0,
                 error: Exception | None = None, timeout_s: float = 2.0, cost_usd: float = 0.001,
                 gate: asyncio.Event | None = None) -> None:
        super().__init__(name, cost_usd=cost_usd, timeout_s=timeout_s, k=10)
        self.urls, self.delay_s, self.error, self.gate = urls, delay_s, error, gate
        self.calls: list[str] = []
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def search(self, query: str) -> ProviderAnswer:
        self.calls.append(query)
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        cits = tuple(Citation(url=u, title=f"title {u}", rank=i + 1, snippet=f"text of {u}")
                     for i, u in enumerate(self.urls))
        return ProviderAnswer(citations=cits, answer=build_answer(cits), cost_usd=self.cost_usd)


def failing(name: str, message: str = "upstream exploded") -> StaticProvider:
    return StaticProvider(name, error=ProviderError(name, message))


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
