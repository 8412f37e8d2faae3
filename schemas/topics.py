"""The topic registry: every topic's name, message model, key field, partition count, and who
produces and who consumes it.

``producers``/``consumers`` name the services and commands whose code publishes/reads the topic
(``tests/unit/test_topic_registry.py`` checks them against the code, both ways);
``planned_consumers`` names readers that are designed but not built yet. The AsyncAPI document
(``fanroute asyncapi`` → ``docs/asyncapi.json``) is generated from this registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from schemas.adapter import AdapterPublished
from schemas.base import Message
from schemas.calibration import CalibrationRecord, Review
from schemas.call import Call
from schemas.cycle import CycleRecord
from schemas.episode import Episode
from schemas.rollout import RolloutGroup
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
    description: str = ""
    producers: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    planned_consumers: tuple[str, ...] = ()

    @property
    def dlq(self) -> str:
        return f"{self.name}.dlq"

    def key_of(self, message: Message) -> bytes:
        """The record key: the message's id, so ordering is per id and compaction is possible."""
        return str(getattr(message, self.key_field)).encode()


TOPICS: dict[str, TopicSpec] = {
    spec.name: spec
    for spec in (
        TopicSpec("traces", Trace, "trace_id", partitions=6,
                  description="One search request: every candidate provider's answer (fan-out) or the "
                              "routed one, with timings and signals.",
                  producers=("gateway",),
                  consumers=("judge", "episodes", "evaluate", "console", "calibrate CLI", "traces CLI", "demo", "loop demo")),
        TopicSpec("verdicts", Verdict, "trace_id", partitions=6,
                  description="The judge's blind grades and tiered ordering of one trace's candidates.",
                  producers=("judge",),
                  consumers=("episodes", "judge", "trainer", "console", "calibrate CLI", "demo", "loop", "loop demo")),
        TopicSpec("episodes", Episode, "episode_id", partitions=6,
                  description="A training episode (router prompt, ordering, reward components).",
                  producers=("episodes", "gateway"),
                  consumers=("trainer", "episodes CLI", "episodes", "demo", "loop", "loop demo")),
        TopicSpec("tasks", Task, "task_id", partitions=3,
                  description="A replay task built from a judged trace (Harbor task layout).",
                  producers=("episodes", "trainer", "rl recipes"),
                  consumers=("episodes CLI", "demo", "rollouts")),
        TopicSpec("adapters", AdapterPublished, "model_id", partitions=1,
                  description="A published or promoted router adapter version.",
                  producers=("publisher",),
                  consumers=("gateway", "sampler", "rollouts", "console")),
        TopicSpec("calibrations", CalibrationRecord, "gate_key", partitions=1,
                  description="A judge calibration result; the newest per gate key opens or closes training.",
                  producers=("calibrate CLI", "demo"),
                  consumers=("trainer", "calibrate CLI")),
        TopicSpec("reviews", Review, "verdict_id", partitions=3,
                  description="A person's mark on one verdict: agree, or disagree with their own ordering "
                              "(the console's buttons, fanroute calibrate mark).",
                  producers=("console", "calibrate CLI"),
                  consumers=("console", "calibrate CLI")),
        TopicSpec("calls", Call, "trace_id", partitions=6,
                  description="One model call a harness made through the relay: prompt ids, sampled ids and "
                              "their logprobs, the disposition, the adapter version, timings, the request.",
                  producers=("relay",),
                  planned_consumers=("call audit and replay tools (not yet built; the rollout records carry "
                                     "each rollout's calls)",)),
        TopicSpec("rollouts", RolloutGroup, "group_id", partitions=3,
                  description="A group of rollouts of one replay task under one adapter version: each rollout's "
                              "harness output, relay calls, reward and datums (advantage = reward - group mean).",
                  producers=("rollouts",),
                  consumers=("trainer", "rl recipes", "rollouts")),
        TopicSpec("cycles", CycleRecord, "cycle_id", partitions=1,
                  description="One phase of one continual-loop cycle (started, trained, evaluated, promoted, "
                              "finished, skipped, failed): dataset as-of, episodes, adapter in and out, eval "
                              "figures, the decision, the drift on the fan-out slice, timings.",
                  producers=("loop",),
                  consumers=("loop", "console")),
    )
}


class HasNamespace(Protocol):
    """Anything with a ``topic_namespace`` (``services.common.settings.KafkaSettings``)."""

    @property
    def topic_namespace(self) -> str: ...


def wire_name(settings: HasNamespace, spec: TopicSpec) -> str:
    """The topic's name on the wire: the settings' namespace prefix + the registry name."""
    return f"{settings.topic_namespace}{spec.name}"


def dlq_wire_name(settings: HasNamespace, spec: TopicSpec) -> str:
    """The wire name of ``spec``'s dead-letter topic."""
    return f"{settings.topic_namespace}{spec.dlq}"


def topic(name: str) -> TopicSpec:
    """Look up a topic by name; a typo is a clear error, not a silent new topic."""
    try:
        return TOPICS[name]
    except KeyError:
        raise KeyError(f"unknown topic {name!r}; known: {sorted(TOPICS)}") from None
