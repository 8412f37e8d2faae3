"""People's agree/disagree marks (the ``reviews`` topic) as human orderings beside the judge's.

An *agree* says the judge's ordering is the person's; a *disagree* carries the person's own ordering (the
console asks for it). Each (verdict, reviewer) counts once, its newest mark winning, so the gate can be
recomputed from people's labels with the same agreement measure as the qrels' (``calibrate report
--source reviews``). A disagree without an ordering (``calibrate mark`` from the command line) is
counted but cannot be compared.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from schemas.calibration import Review
from schemas.topics import topic
from schemas.verdict import Verdict
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.judge.calibration.metrics import TracePair


@dataclass
class ReviewCounts:
    """How many reviews there are, how they split, and per provider (the judge's first choice) agree/disagree."""

    reviews: int = 0
    agree: int = 0
    disagree: int = 0
    compared: int = 0
    without_ordering: int = 0
    unknown_verdict: int = 0
    other_judge: int = 0
    per_provider: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def render(self) -> str:
        lines = [f"reviews: {self.reviews} ({self.agree} agree, {self.disagree} disagree); {self.compared} compared"
                 f" with the judge, {self.without_ordering} disagree without an ordering, {self.unknown_verdict} "
                 f"for a verdict not on the topic, {self.other_judge} for another judge",
                 f"{'provider (judge first)':<24} {'agree':>6} {'disagree':>9}"]
        lines += [f"{p:<24} {c['agree']:>6} {c['disagree']:>9}" for p, c in sorted(self.per_provider.items())]
        return "\n".join(lines)


def latest_reviews(reviews: list[Review]) -> list[Review]:
    """One review per (verdict, reviewer): the newest."""
    newest: dict[str, Review] = {}
    for r in reviews:
        if r.review_id not in newest or r.created_at >= newest[r.review_id].created_at:
            newest[r.review_id] = r
    return sorted(newest.values(), key=lambda r: r.review_id)


def review_pairs(reviews: list[Review], verdicts: dict[str, Verdict],
                 judge: tuple[str, str, str] | None = None) -> tuple[list[TracePair], ReviewCounts]:
    """(judge ordering, person's ordering) per review of an ok verdict of ``judge`` (kind, model, rubric hash;
    None: any judge), and the counts."""
    counts, pairs = ReviewCounts(), []
    for r in latest_reviews(reviews):
        counts.reviews += 1
        counts.agree += r.mark == "agree"
        counts.disagree += r.mark == "disagree"
        v = verdicts.get(r.verdict_id)
        if v is None or v.status != "ok":
            counts.unknown_verdict += 1
            continue
        if judge is not None and (v.judge_kind, v.judge_model, v.rubric_hash) != judge:
            counts.other_judge += 1
            continue
        for provider in v.ordering[0] if v.ordering else ():
            counts.per_provider[provider][r.mark] += 1
        human = v.ordering if r.mark == "agree" else r.ordering
        if not human:
            counts.without_ordering += 1
            continue
        counts.compared += 1
        pairs.append(TracePair(r.review_id, v.ordering, human))
    return pairs, counts


async def read_review_pairs(kafka: KafkaSettings, judge: tuple[str, str, str] | None = None
                            ) -> tuple[list[TracePair], ReviewCounts]:
    """:func:`review_pairs` over what the ``reviews`` and ``verdicts`` topics hold now."""
    reviews = [r async for r in read_topic(kafka, topic("reviews"), model=Review)]
    wanted = {r.verdict_id for r in reviews}
    verdicts = {v.verdict_id: v async for v in read_topic(kafka, topic("verdicts"), model=Verdict)
                if v.verdict_id in wanted}
    return review_pairs(reviews, verdicts, judge)
