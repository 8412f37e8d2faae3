"""The topic registry: every topic's name, message model, key field and partition count."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.adapter import AdapterPublished
from schemas.base import Message
from schemas.calibration import CalibrationRecord, Review
from schemas.episode import Episode
from schemas.task import Task
from schemas.trace import Trace
from schemas.verdict import Verdict


@dataclass(frozen=True)
class TopicSpec:
    """How one topic is laid out; ``retention_ms=-1`` keeps everything (Kafka is the source of truth)."""

    name: str
    model: type[Message]
    key_field: str
    partitions: int
    retention_ms: int = -1

    @property
    def dlq(self) -> str:
        return f"{self.name}.dlq"

    def key_of(self, message: Message) -> bytes:
        """The record key: the message's id, so ordering is per id and compaction is possible."""
        return str(getattr(message, self.key_field)).encode()


TOPICS: dict[str, TopicSpec] = {
    spec.name: spec
    for spec in (
        TopicSpec("traces", Trace, "trace_id", partitions=6),
        TopicSpec("verdicts", Verdict, "trace_id", partitions=6),
        TopicSpec("episodes", Episode, "episode_id", partitions=6),
        TopicSpec("tasks", Task, "task_id", partitions=3),
        TopicSpec("adapters", AdapterPublished, "model_id", partitions=1),
        TopicSpec("calibrations", CalibrationRecord, "gate_key", partitions=1),
        TopicSpec("reviews", Review, "verdict_id", partitions=3),
    )
}


def topic(name: str) -> TopicSpec:
    """Look up a topic by name; a typo is a clear error, not a silent new topic."""
    try:
        return TOPICS[name]
    except KeyError:
        raise KeyError(f"unknown topic {name!r}; known: {sorted(TOPICS)}") from None
