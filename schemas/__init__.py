"""Messages that travel on fanroute's Kafka topics: one module per topic.

Every message is a frozen pydantic model with a ``schema_version``; :func:`schemas.base.decode`
refuses a version this build does not read with a clear error.
"""

from schemas.adapter import AdapterPublished
from schemas.base import Message, decode
from schemas.call import Call, CallTimings
from schemas.dead_letter import DeadLetter
from schemas.episode import ChatMessage, Episode, RewardComponent
from schemas.rollout import CommandRun, Rollout, RolloutGroup
from schemas.task import Task
from schemas.topics import TOPICS, TopicSpec, topic
from schemas.trace import Candidate, Citation, Route, Signals, Trace
from schemas.verdict import CandidateGrade, Verdict

__all__ = [
    "AdapterPublished", "Call", "CallTimings", "Candidate", "CandidateGrade", "ChatMessage", "Citation", "DeadLetter",
    "CommandRun", "Episode", "Message", "RewardComponent", "Rollout", "RolloutGroup", "Route", "Signals", "Task",
    "TOPICS", "TopicSpec", "Trace",
    "Verdict", "decode", "topic",
]
