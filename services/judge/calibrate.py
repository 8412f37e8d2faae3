"""``fanroute calibrate``: measure the judge against human labels and keep the gate.

Human labels come from the collections' qrels (real judgments nobody here wrote) or from a
hand-ranked export. The gate is a :class:`schemas.calibration.CalibrationRecord` on the
``calibrations`` topic, keyed by (judge, rubric hash, provider set).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from schemas.base import content_id
from schemas.calibration import CalibrationRecord, ProviderAgreement, Review, gate_key, review_id
from schemas.topics import topic
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.common.splits import dev_half
from services.judge.base import JudgeBackend
from services.judge.blind import blind
from services.judge.calibration.human import QrelsStore, human_grades
from services.judge.calibration.metrics import (
    AgreementReport,
    TracePair,
    agreement_report,
)
from services.judge.worker import to_providers
from services.providers.collections import sample_queries
from services.providers.config import LatencyModel, ProviderConfig
from services.providers.fanout import fan_out_trace
from services.providers.registry import build_provider


async def offline_traces(providers: list[ProviderConfig], *, n: int | None, seed: int,
                         contested_threshold: float, half: str | None = None) -> list[Trace]:
    """Fan the collections' dev queries out to ``providers`` in-process (no latency model, no bus).

    ``half`` keeps only the ``"tune"`` or ``"validation"`` half of the dev queries (None: all);
    ``n`` then takes the first ``n`` of them in a ``seed``-shuffled order (None: every one)."""
    live = [build_provider(cfg.model_copy(update={"latency": LatencyModel()})
                           if hasattr(cfg, "latency") else cfg) for cfg in providers if cfg.enabled]
    await asyncio.gather(*(p.start() for p in live))
    try:
        out = []
        queries = [q for q in sample_queries(seed=seed) if half is None or dev_half(q.query_id) == half][:n]
        for q in tqdm(queries, desc="fan-out", unit="q"):
            out.append(await fan_out_trace(live, q.text, query_id=q.query_id,
                                           trace_id=content_id("calibration", q.query_id),
                                           deadline_s=60, contested_threshold=contested_threshold))
        return out
    finally:
        await asyncio.gather(*(p.close() for p in live))


async def judge_tiers(backend: JudgeBackend, traces: list[Trace]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """The judge's ordering of each trace's providers (blind, exactly as the worker does it)."""
    out = {}
    for t in tqdm(traces, desc="judge", unit="trace"):
        seen = blind(t, 0)
        _, ordering = to_providers(seen, await backend.judge(seen.request))
        out[t.trace_id] = ordering
    return out


def against_qrels(traces: list[Trace], judged: dict[str, tuple[tuple[str, ...], ...]],
                  qrels: QrelsStore | None = None) -> AgreementReport:
    """Agreement of the judge's orderings with the qrels-derived human orderings."""
    store = qrels or QrelsStore()
    pairs = []
    for t in traces:
        human = human_grades(t, store)
        if human is not None and t.trace_id in judged:
            pairs.append(TracePair(t.trace_id, judged[t.trace_id], human.ordering))
    return agreement_report(pairs)


def record_for(report: AgreementReport, backend: JudgeBackend, providers: list[str], *,
               source: str, threshold: float) -> CalibrationRecord:
    """The gate record: open when tau-b (all-tied judges counting 0) reaches ``threshold``."""
    o = report.overall
    tau = None if math.isnan(o.tau_informative) else round(o.tau_informative, 4)
    ident, rubric = backend.identity, backend.rubric
    return CalibrationRecord(
        gate_key=gate_key(ident.kind, ident.model, rubric, providers), created_at=datetime.now(UTC),
        judge_kind=ident.kind, judge_model=ident.model, rubric_hash=rubric,
        providers=tuple(sorted(providers)), human_source=source, tau_b=tau,
        top1=None if math.isnan(o.top1) else round(o.top1, 4), n=o.n_informative, threshold=threshold,
        open=tau is not None and tau >= threshold,
        per_provider={p: ProviderAgreement(tau_b=_finite(a.tau), top1=_finite(a.both_top), n=a.n)
                      for p, a in report.per_provider.items()})


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


async def verdict_tiers(kafka: KafkaSettings, backend: JudgeBackend) -> dict[str, tuple[tuple[str, ...], ...]]:
    """This judge's ok verdicts on the topic, as trace id → ordering."""
    out = {}
    ident, rubric = backend.identity, backend.rubric
    async for v in read_topic(kafka, topic("verdicts"), model=Verdict):
        if (v.status, v.judge_kind, v.judge_model, v.rubric_hash) == ("ok", ident.kind, ident.model, rubric):
            out.setdefault(v.trace_id, v.ordering)
    return out


def review(verdict_id: str, reviewer: str, mark: str, note: str = "") -> Review:
    """A review mark; its id is derived from (verdict, reviewer), so a re-mark replaces by key."""
    return Review(review_id=review_id(verdict_id, reviewer), verdict_id=verdict_id,
                  reviewer=reviewer, mark=mark, note=note, created_at=datetime.now(UTC))


def write_json(report: AgreementReport, record: CalibrationRecord, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"report": asdict(report), "record": record.model_dump(mode="json")},
                               indent=2, default=str) + "\n")
