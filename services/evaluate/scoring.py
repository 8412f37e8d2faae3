"""Quality of every answer in a held-out trace: the judge's grade and the humans' nDCG@10.

Judge: one blind call per trace over every provider's answer PLUS the RRF-fused list as one more
candidate (:data:`~services.evaluate.policies.FUSED`). One call, because a judge's grade of an answer
can depend on the other answers it is shown (the local judge weighs query terms by IDF over the
request's own sources; a listwise LLM judge compares), so every policy's answer to a query is graded
in the same context. These grades can therefore differ from the judge worker's verdict on the same
trace, which never sees the fused list. Failed providers get 0 by rule, as in the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from schemas.trace import Candidate, Citation, Trace
from services.common.ir import ndcg_at_k
from services.common.progress import gather_bounded
from services.evaluate.policies import FUSED
from services.judge.base import JudgeBackend, JudgeFailed
from services.judge.blind import blind
from services.judge.calibration.human import (
    K,
    QrelsStore,
    human_grades,
    ranked_doc_ids,
    split_query_id,
)
from services.judge.worker import to_providers
from services.providers.base import build_answer
from services.providers.fusion import rrf

log = logging.getLogger(__name__)


def fused_candidate(trace: Trace) -> Candidate:
    """The fan-out policy's answer as one more candidate: the RRF list, answer text built like a provider's."""
    fused = rrf(trace.candidates)
    if not fused:
        return Candidate(provider=FUSED, latency_ms=0, cost_usd=0, error="no provider answered",
                         error_kind="empty")
    cits = tuple(Citation(url=f.url, title=f.title, snippet=f.snippet, rank=i + 1) for i, f in enumerate(fused))
    return Candidate(provider=FUSED, answer=build_answer(cits), citations=cits, latency_ms=0, cost_usd=0)


def with_fused(trace: Trace) -> Trace:
    """``trace`` with the fused list appended as a candidate (what the judge is shown)."""
    if any(c.provider == FUSED for c in trace.candidates):
        raise ValueError(f"trace {trace.trace_id} already has a provider named {FUSED!r}")
    return trace.model_copy(update={"candidates": (*trace.candidates, fused_candidate(trace))})


async def judge_grades(backend: JudgeBackend, trace: Trace, hide: tuple[str, ...] = ()) -> dict[str, int] | None:
    """Grade of every provider and of the fused list, blind, in one call; None when the judge failed."""
    seen = blind(with_fused(trace), 0, hide=hide)
    try:
        result = await backend.judge(seen.request)
    except JudgeFailed as exc:
        log.warning("judge failed on trace %s: %s", trace.trace_id, exc)
        return None
    grades, _ = to_providers(seen, result)
    return {g.provider: g.grade for g in grades}


async def judge_all(backend: JudgeBackend, traces: Sequence[Trace], *, hide: tuple[str, ...] = (),
                    concurrency: int = 4, progress: bool = True) -> dict[str, dict[str, int] | None]:
    """trace id → grades (None: judge failed), at most ``concurrency`` judge calls in flight."""
    async def one(t: Trace) -> tuple[str, dict[str, int] | None]:
        return t.trace_id, await judge_grades(backend, t, hide)

    return dict(await gather_bounded(one, traces, concurrency=concurrency, desc="judge", unit="trace",
                                     progress=progress))


def human_scores(trace: Trace, store: QrelsStore) -> dict[str, float] | None:
    """nDCG@10 of every provider's and of the fused list's results against the query's qrels.

    None when the query has no qrels (or only non-relevant judgments): it cannot tell answers apart.
    """
    human = human_grades(trace, store)
    if human is None:
        return None
    ref = split_query_id(trace.query_id)
    assert ref is not None
    judged = store.judged(*ref) or {}
    fused = ndcg_at_k(ranked_doc_ids([f.url for f in rrf(trace.candidates)], ref[0]), judged, K)
    return {**human.ndcg, FUSED: fused}
