"""The calibration gate reader: which (judge, rubric, provider set) may train a router.

``fanroute calibrate report --publish`` writes :class:`~schemas.calibration.CalibrationRecord`s to
the ``calibrations`` topic; the trainer, the calibrate CLI and the demo read them back here. The
topic is read once per lookup, and the newest record per gate key wins.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.calibration import CalibrationRecord, gate_key
from schemas.topics import topic
from services.common import replay_topic
from services.common.prompt import JudgeKey
from services.common.settings import KafkaSettings


class Gates:
    """The newest calibration record per gate key, as read from the topic at one moment."""

    def __init__(self, records: Iterable[CalibrationRecord]) -> None:
        self.latest: dict[str, CalibrationRecord] = {}
        for rec in records:
            held = self.latest.get(rec.gate_key)
            if held is None or rec.created_at >= held.created_at:
                self.latest[rec.gate_key] = rec

    def get(self, key: str) -> CalibrationRecord | None:
        """The newest record for ``key`` (None: never calibrated)."""
        return self.latest.get(key)

    def for_judge(self, judge: JudgeKey, providers: Iterable[str]) -> CalibrationRecord | None:
        """The newest gate whose judge model matches, whose rubric hash starts with the episode's prefix
        and whose provider set is ``providers`` (an episode names only the first 8 hex of its rubric)."""
        wanted = tuple(sorted(providers))
        found = [rec for rec in self.latest.values()
                 if rec.judge_model == judge.judge_model and rec.rubric_hash.startswith(judge.rubric_prefix)
                 and rec.gate_key == gate_key(rec.judge_kind, rec.judge_model, rec.rubric_hash, wanted)]
        return max(found, key=lambda r: r.created_at, default=None)


async def read_gates(kafka: KafkaSettings) -> Gates:
    """Every calibration record on the topic up to its end now (records that do not decode are skipped)."""
    return Gates([rec async for rec in replay_topic.read_topic(kafka, topic("calibrations"), model=CalibrationRecord)])


async def latest_gate(kafka: KafkaSettings, key: str) -> CalibrationRecord | None:
    """The newest calibration record for ``key`` on the topic (None: never calibrated)."""
    return (await read_gates(kafka)).get(key)
