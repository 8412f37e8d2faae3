"""Drift on the fan-out slice: each provider's judged grade since the deployed router's cycle against the
window that router was trained on.

Only the slice is fanned out, so only its traces carry every provider's answer and a verdict grading
each: it is where a provider that got worse shows first. The score is the largest per-provider change
of the mean grade, as a share of the grade scale (0–3), over providers with enough verdicts in both
windows; past the threshold the loop runs a cycle early.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from schemas.cycle import Drift, ProviderDrift
from schemas.topics import topic
from schemas.verdict import Verdict
from services.common.replay_topic import read_topic_records
from services.common.settings import KafkaSettings

GRADE_SCALE = 3.0


def drift_of(reference: dict[str, list[float]], recent: dict[str, list[float]], *, threshold: float,
             min_n: int, reference_until: datetime | None = None, recent_since: datetime | None = None) -> Drift:
    """The drift between two windows of per-provider grades (pure)."""
    rows, worst, score = [], None, None
    for provider in sorted(set(reference) | set(recent)):
        a, b = reference.get(provider, []), recent.get(provider, [])
        ma = sum(a) / len(a) if a else None
        mb = sum(b) / len(b) if b else None
        delta = mb - ma if (ma is not None and mb is not None and len(a) >= min_n and len(b) >= min_n) else None
        rows.append(ProviderDrift(provider=provider, reference_mean=ma, recent_mean=mb, reference_n=len(a),
                                  recent_n=len(b), delta=delta))
        if delta is not None and (score is None or abs(delta) / GRADE_SCALE > score):
            score, worst = abs(delta) / GRADE_SCALE, provider
    return Drift(score=score, threshold=threshold, triggered=score is not None and score >= threshold, worst=worst,
                 reference_until=reference_until, recent_since=recent_since, providers=tuple(rows))


async def slice_grades(kafka: KafkaSettings, since: datetime | None, until: datetime | None) -> dict[str, list[float]]:
    """provider → the judge's grades of its answers in the fan-out verdicts appended in [since, until)."""
    out: dict[str, list[float]] = defaultdict(list)
    async for rec in read_topic_records(kafka, topic("verdicts"), model=Verdict, since=since, until=until):
        v = rec.message
        if v.status != "ok" or len(v.grades) < 2:  # a routed trace's verdict grades one answer: not the slice
            continue
        for g in v.grades:
            out[g.provider].append(float(g.grade))
    return dict(out)


async def measure_drift(kafka: KafkaSettings, reference_until: datetime | None, window_s: float | None, *,
                        threshold: float, min_n: int, now: datetime) -> Drift:
    """Drift of the slice since ``reference_until`` (the reference cycle's slot) against the window before it."""
    if reference_until is None:
        return Drift(score=None, threshold=threshold, triggered=False)
    since = reference_until - timedelta(seconds=window_s) if window_s else None
    reference = await slice_grades(kafka, since, reference_until)
    recent = await slice_grades(kafka, reference_until, now)
    return drift_of(reference, recent, threshold=threshold, min_n=min_n, reference_until=reference_until,
                    recent_since=reference_until)
