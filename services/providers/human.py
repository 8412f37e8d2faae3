"""Human-derived grades for a trace: each candidate's nDCG@10 against the collection's qrels.

The test collections' qrels are human relevance judgments nobody here wrote, so a candidate's
nDCG@10 over its citations is a human verdict on it. It maps to the judge's 0–3 scale with
:data:`NDCG_CUTS`: ``0 -> 0``, ``(0, 0.3) -> 1``, ``[0.3, 0.6) -> 2``, ``>= 0.6 -> 3``. A failed
candidate scores 0. The human ordering is the candidates in tiers of equal nDCG, best first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from schemas.trace import Trace
from services.common.ir import ndcg_at_k
from services.providers.collections import (
    URL_SCHEME,
    default_collections_dir,
    load_qrels,
    parse_doc_url,
)
from services.providers.config import ALL_COLLECTIONS

#: nDCG@10 lower bounds of grades 2 and 3; any nDCG above 0 is at least grade 1.
NDCG_CUTS: tuple[float, float] = (0.3, 0.6)
#: nDCG values are rounded to this many places before tiering, so float noise never splits a tie.
TIE_DECIMALS = 9
K = 10
#: Provider names in tiers, best first; names in one tier are tied.
Tiers = tuple[tuple[str, ...], ...]

Qrels = Mapping[str, int]


@dataclass(frozen=True)
class HumanGrades:
    """The qrels-derived verdict on one trace."""

    trace_id: str
    collection: str
    query_id: str
    ndcg: dict[str, float]
    grades: dict[str, int]
    ordering: Tiers


def ndcg_grade(value: float, cuts: Sequence[float] = NDCG_CUTS) -> int:
    """0 for no gain at all, else 1 plus the number of ``cuts`` reached."""
    if value <= 0:
        return 0
    return 1 + sum(value >= c for c in cuts)


def ranked_doc_ids(urls: Sequence[str], collection: str) -> list[str]:
    """Ranked ids to score against ``collection``'s qrels.

    A citation from another collection, the web or a malformed ``collection://`` URL keeps its
    rank but can never match: doc ids are only unique within a collection (cisi/12 is not adi/12).
    """
    out = []
    for url in urls:
        try:
            ref = parse_doc_url(url) if url.startswith(URL_SCHEME) else None
        except ValueError:
            ref = None
        out.append(ref.doc_id if ref is not None and ref.collection == collection else f"\0{url}")
    return out


def tiers_by_value(values: Mapping[str, float], decimals: int = TIE_DECIMALS) -> Tiers:
    """Names in tiers of equal (rounded) value, best first; names sorted within a tier."""
    rounded = {k: round(v, decimals) for k, v in values.items()}
    return tuple(tuple(sorted(k for k, v in rounded.items() if v == level))
                 for level in sorted(set(rounded.values()), reverse=True))


def split_query_id(query_id: str | None) -> tuple[str, str] | None:
    """``(collection, query_id)`` of a ``"<collection>/<query_id>"`` id, or None if not one."""
    if not query_id or "/" not in query_id:
        return None
    collection, qid = query_id.split("/", 1)
    return (collection, qid) if collection in ALL_COLLECTIONS and qid else None


def grades_from_qrels(trace: Trace, collection: str, query_id: str, judged: Qrels) -> HumanGrades:
    """The human grades of ``trace`` given its query's judgments in ``collection``."""
    ndcg = {c.provider: ndcg_at_k(ranked_doc_ids([x.url for x in c.citations], collection),
                                  judged, K) if c.ok else 0.0
            for c in trace.candidates}
    return HumanGrades(trace_id=trace.trace_id, collection=collection, query_id=query_id,
                       ndcg=ndcg, grades={p: ndcg_grade(v) for p, v in ndcg.items()},
                       ordering=tiers_by_value(ndcg))


class QrelsStore:
    """The collections' qrels, each loaded on first use."""

    def __init__(self, collections_dir: Path | None = None) -> None:
        self._dir = collections_dir
        self._by_collection: dict[str, dict[str, dict[str, int]]] = {}

    def judged(self, collection: str, query_id: str) -> dict[str, int] | None:
        """The judgments of one query (None if it has none)."""
        if collection not in self._by_collection:
            directory = self._dir if self._dir is not None else default_collections_dir()
            self._by_collection[collection] = load_qrels(directory, collection)
        return self._by_collection[collection].get(query_id)


def human_grades(trace: Trace, store: QrelsStore) -> HumanGrades | None:
    """The qrels-derived grades of ``trace``; None without a known ``query_id`` or judged-relevant docs.

    A query whose judgments are all grade 0 (or absent) cannot tell candidates apart, so it has
    no human verdict either.
    """
    ref = split_query_id(trace.query_id)
    if ref is None:
        return None
    judged = store.judged(*ref)
    if not judged or not any(g > 0 for g in judged.values()):
        return None
    return grades_from_qrels(trace, ref[0], ref[1], judged)
