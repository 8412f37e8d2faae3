"""What a judge backend sees (blind candidates) and returns (grades and a tiered ordering)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from services.common.errors import FanrouteError


class JudgeFailed(FanrouteError, RuntimeError):
    """The backend could not produce a valid judgement (after its own retries)."""


@dataclass(frozen=True)
class Source:
    """One cited document as the judge sees it: no URL, no provider, just title and text."""

    title: str
    snippet: str


@dataclass(frozen=True)
class BlindCandidate:
    """A candidate relabelled with a letter; nothing in it names or identifies its provider."""

    letter: str
    answer: str
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class JudgeRequest:
    """One judge call: the query and the blind candidates in shuffled order."""

    trace_id: str
    attempt: int
    query: str
    candidates: tuple[BlindCandidate, ...]

    @property
    def letters(self) -> tuple[str, ...]:
        return tuple(c.letter for c in self.candidates)


@dataclass(frozen=True)
class JudgeResult:
    """Grades (0–3, UMBRELA) per letter and a listwise ordering of letters in tiers (ties allowed)."""

    grades: dict[str, int]
    ordering: tuple[tuple[str, ...], ...]
    raw: str = ""


@dataclass(frozen=True)
class JudgeIdentity:
    """Who judges: used in the verdict id, the calibration key and the not-a-provider check."""

    kind: str
    model: str
    endpoint: str | None = None


class JudgeBackend(abc.ABC):
    """A judge. Clients and models load once in :meth:`start`, never per trace."""

    identity: JudgeIdentity
    #: Backend-specific parts of the rubric (e.g. a local judge's grade cut points): hashed with it.
    rubric_extra: str = ""

    @property
    def rubric(self) -> str:
        """This backend's rubric hash: part of its verdict ids and its calibration key."""
        from services.judge.rubric import rubric_hash

        return rubric_hash(self.rubric_extra)

    async def start(self) -> None:
        """Open clients / load models (idempotent)."""

    async def close(self) -> None:
        """Release clients."""

    @abc.abstractmethod
    async def judge(self, request: JudgeRequest) -> JudgeResult:
        """Grade every candidate and order them; raise :class:`JudgeFailed` with the reason."""
