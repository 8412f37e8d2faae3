"""What the ``cycles`` topic says: every cycle of one model id and kind, its phases, the last one that ran.

The topic is the loop's memory: a restarted loop reads it to resume an unfinished cycle under the
same id, to skip a slot that already ran, and to find the window the deployed router was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from schemas.cycle import ENDS, PHASES, CycleRecord
from schemas.topics import topic
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings


@dataclass
class Cycle:
    """One cycle's records by phase (the first record of each phase kept)."""

    cycle_id: str
    slot: datetime
    phases: dict[str, CycleRecord] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return any(p in self.phases for p in ENDS)

    @property
    def last(self) -> CycleRecord:
        rank = {p: i for i, p in enumerate((*PHASES, "skipped", "failed"))}
        return max(self.phases.values(), key=lambda r: (r.at, rank[r.phase]))

    def get(self, phase: str) -> CycleRecord | None:
        return self.phases.get(phase)


@dataclass
class History:
    """The cycles of one (model id, kind), oldest slot first."""

    cycles: list[Cycle]

    def find(self, cycle_id: str) -> Cycle | None:
        return next((c for c in self.cycles if c.cycle_id == cycle_id), None)

    def unfinished(self) -> Cycle | None:
        """The newest cycle that started and never ended (a loop killed mid-cycle), if any."""
        return next((c for c in reversed(self.cycles) if not c.ended), None)

    def last_ran(self) -> Cycle | None:
        """The newest cycle that trained (finished or not): new episodes are counted from its slot."""
        return next((c for c in reversed(self.cycles) if c.get("trained") is not None), None)

    def deployed(self) -> Cycle | None:
        """The newest cycle whose candidate was promoted: its window is drift's reference."""
        return next((c for c in reversed(self.cycles) if c.get("promoted") is not None), None)


async def read_history(kafka: KafkaSettings, model_id: str, kind: str) -> History:
    """Every record of the ``cycles`` topic for ``model_id``/``kind``, grouped by cycle."""
    by_id: dict[str, Cycle] = {}
    async for rec in read_topic(kafka, topic("cycles"), model=CycleRecord):
        if rec.model_id != model_id or rec.kind != kind:
            continue
        cycle = by_id.setdefault(rec.cycle_id, Cycle(rec.cycle_id, rec.slot))
        cycle.phases.setdefault(rec.phase, rec)
    return History(sorted(by_id.values(), key=lambda c: c.slot))
