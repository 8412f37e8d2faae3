"""What the console read from the topics, in one SQLite file: traces, verdicts, reviews, adapter events, the
loop's cycle records and, per topic partition, the next offset to read.

Why SQLite: the topics grow without bound and a page must answer in milliseconds, so the console keeps rows
on disk with the indexes its filters use, not a list in memory; a restart resumes from the stored offsets.
Every row is keyed by its message's id, so a record read twice is stored once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas.adapter import AdapterPublished
from schemas.base import decode
from schemas.calibration import Review, gate_key
from schemas.cycle import CycleRecord
from schemas.trace import Trace
from schemas.verdict import Verdict

_SCHEMA = """
CREATE TABLE IF NOT EXISTS traces (
    trace_id TEXT PRIMARY KEY, received_ms INTEGER NOT NULL, query TEXT NOT NULL, query_id TEXT,
    collection TEXT, mode TEXT NOT NULL, contested INTEGER NOT NULL, mean_overlap REAL NOT NULL,
    providers TEXT NOT NULL, routed_to TEXT, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS traces_time ON traces (received_ms DESC, trace_id);
CREATE INDEX IF NOT EXISTS traces_collection ON traces (collection, received_ms DESC);
CREATE TABLE IF NOT EXISTS verdicts (
    verdict_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, judge_key TEXT NOT NULL, status TEXT NOT NULL,
    judged_ms INTEGER NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS verdicts_trace ON verdicts (trace_id);
CREATE TABLE IF NOT EXISTS reviews (
    review_id TEXT PRIMARY KEY, verdict_id TEXT NOT NULL, reviewer TEXT NOT NULL, mark TEXT NOT NULL,
    created_ms INTEGER NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS reviews_verdict ON reviews (verdict_id);
CREATE TABLE IF NOT EXISTS adapters (
    event_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, version INTEGER NOT NULL, promoted INTEGER NOT NULL,
    published_ms INTEGER NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS cycles (
    record_id TEXT PRIMARY KEY, cycle_id TEXT NOT NULL, phase TEXT NOT NULL, at_ms INTEGER NOT NULL,
    slot_ms INTEGER NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS cycles_slot ON cycles (slot_ms DESC, cycle_id);
CREATE TABLE IF NOT EXISTS offsets (topic TEXT NOT NULL, partition INTEGER NOT NULL, next INTEGER NOT NULL,
    PRIMARY KEY (topic, partition));
"""


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def verdict_judge_key(v: Verdict) -> str:
    """The gate key of the judge that wrote ``v`` (its kind, model, rubric and the providers it graded)."""
    return gate_key(v.judge_kind, v.judge_model, v.rubric_hash, [g.provider for g in v.grades])


@dataclass(frozen=True)
class TraceFilter:
    """The trace list's filters (None: not filtered)."""

    text: str | None = None
    contested: bool | None = None
    judged: bool | None = None
    provider: str | None = None
    collection: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition and its parameters."""
        conds, args = [], []
        if self.text:
            conds.append("instr(lower(t.query), ?) > 0")
            args.append(self.text.lower())
        if self.contested is not None:
            conds.append("t.contested = ?")
            args.append(int(self.contested))
        if self.judged is not None:
            conds.append(("" if self.judged else "NOT ") + "EXISTS (SELECT 1 FROM verdicts v WHERE v.trace_id = "
                         "t.trace_id AND v.status = 'ok')")
        if self.provider:
            conds.append("instr(t.providers, ?) > 0")
            args.append(f"|{self.provider}|")
        if self.collection:
            conds.append("t.collection = ?")
            args.append(self.collection)
        if self.since_ms is not None:
            conds.append("t.received_ms >= ?")
            args.append(self.since_ms)
        if self.until_ms is not None:
            conds.append("t.received_ms < ?")
            args.append(self.until_ms)
        return (" WHERE " + " AND ".join(conds)) if conds else "", args


@dataclass(frozen=True)
class TraceRow:
    """One line of the trace list."""

    trace_id: str
    received_ms: int
    query: str
    collection: str | None
    mode: str
    contested: bool
    mean_overlap: float
    providers: tuple[str, ...]
    routed_to: str | None
    verdicts: int
    reviews: int


class ConsoleStore:
    """The SQLite store; safe to call from the event loop's thread and from worker threads (one lock)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ writes (the follower)
    def offsets(self, topic: str) -> dict[int, int]:
        """Partition → the next offset to read of ``topic``."""
        with self._lock:
            return dict(self._db.execute("SELECT partition, next FROM offsets WHERE topic = ?", (topic,)))

    def ingest(self, topic: str, records: Sequence[Any]) -> int:
        """Store a batch of :class:`~services.common.replay_topic.TopicRecord` and advance ``topic``'s offsets,
        in one transaction (a crash stores all of it or none). Returns how many messages were stored."""
        stored = 0
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for rec in records:
                    if rec.message is not None:
                        self._put(rec.message)
                        stored += 1
                    self._db.execute("INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, partition) DO UPDATE "
                                     "SET next = max(next, excluded.next)", (topic, rec.partition, rec.offset + 1))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return stored

    def put(self, message: Any) -> None:
        """Store one message outside a topic batch (a review the console just published; offsets untouched)."""
        with self._lock:
            self._put(message)

    def _put(self, m: Any) -> None:
        if isinstance(m, Trace):
            collection = m.query_id.split("/", 1)[0] if m.query_id and "/" in m.query_id else None
            routed = m.route.called[0] if m.route is not None else None
            self._db.execute("INSERT OR REPLACE INTO traces VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
                m.trace_id, _ms(m.received_at), m.query, m.query_id, collection, m.mode, int(m.signals.contested),
                m.signals.mean_overlap, "|" + "|".join(c.provider for c in m.candidates) + "|", routed, m.to_bytes()))
        elif isinstance(m, Verdict):
            self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?,?,?,?,?,?)", (
                m.verdict_id, m.trace_id, verdict_judge_key(m), m.status, _ms(m.judged_at), m.to_bytes()))
        elif isinstance(m, Review):
            self._db.execute("INSERT INTO reviews VALUES (?,?,?,?,?,?) ON CONFLICT (review_id) DO UPDATE SET "
                             "mark = excluded.mark, created_ms = excluded.created_ms, body = excluded.body "
                             "WHERE excluded.created_ms >= reviews.created_ms", (
                                 m.review_id, m.verdict_id, m.reviewer, m.mark, _ms(m.created_at), m.to_bytes()))
        elif isinstance(m, AdapterPublished):
            self._db.execute("INSERT OR REPLACE INTO adapters VALUES (?,?,?,?,?,?)", (
                f"{m.model_id}@{m.version}:{'promoted' if m.promoted else 'published'}:{_ms(m.published_at)}",
                m.model_id, m.version, int(m.promoted), _ms(m.published_at), m.to_bytes()))
        elif isinstance(m, CycleRecord):  # a phase written again after a restart is the same record
            self._db.execute("INSERT OR REPLACE INTO cycles VALUES (?,?,?,?,?,?)", (
                m.record_id, m.cycle_id, m.phase, _ms(m.at), _ms(m.slot), m.to_bytes()))

    # ------------------------------------------------------------------ reads (the pages)
    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def count_traces(self, f: TraceFilter) -> int:
        where, args = f.where()
        return self._all(f"SELECT count(*) FROM traces t{where}", args)[0][0]

    def list_traces(self, f: TraceFilter, *, limit: int, offset: int) -> list[TraceRow]:
        """One page of the list, newest first, with each trace's verdict and review counts."""
        where, args = f.where()
        rows = self._all(
            "SELECT t.trace_id, t.received_ms, t.query, t.collection, t.mode, t.contested, t.mean_overlap, "
            "t.providers, t.routed_to, (SELECT count(*) FROM verdicts v WHERE v.trace_id = t.trace_id), "
            "(SELECT count(*) FROM reviews r JOIN verdicts v ON r.verdict_id = v.verdict_id "
            f"WHERE v.trace_id = t.trace_id) FROM traces t{where} ORDER BY t.received_ms DESC, t.trace_id "
            "LIMIT ? OFFSET ?", [*args, limit, offset])
        return [TraceRow(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6], tuple(p for p in r[7].split("|") if p),
                         r[8], r[9], r[10]) for r in rows]

    def trace(self, trace_id: str) -> Trace | None:
        rows = self._all("SELECT body FROM traces WHERE trace_id = ?", (trace_id,))
        return decode(Trace, rows[0][0]) if rows else None

    def verdicts_of(self, trace_id: str) -> list[tuple[Verdict, str]]:
        """The trace's verdicts, newest first, each with its judge key."""
        rows = self._all("SELECT body, judge_key FROM verdicts WHERE trace_id = ? ORDER BY judged_ms DESC",
                         (trace_id,))
        return [(decode(Verdict, b), k) for b, k in rows]

    def verdict(self, verdict_id: str) -> tuple[Verdict, str] | None:
        rows = self._all("SELECT body, judge_key FROM verdicts WHERE verdict_id = ?", (verdict_id,))
        return (decode(Verdict, rows[0][0]), rows[0][1]) if rows else None

    def reviews_of(self, verdict_ids: Sequence[str]) -> list[Review]:
        if not verdict_ids:
            return []
        marks = ",".join("?" * len(verdict_ids))
        return [decode(Review, b) for (b,) in self._all(
            f"SELECT body FROM reviews WHERE verdict_id IN ({marks}) ORDER BY created_ms DESC", verdict_ids)]

    def adapters(self) -> list[AdapterPublished]:
        """Every adapter event, newest first."""
        return [decode(AdapterPublished, b) for (b,) in self._all(
            "SELECT body FROM adapters ORDER BY published_ms DESC, version DESC")]

    def cycles(self, *, limit: int) -> list[list[CycleRecord]]:
        """The ``limit`` newest cycles by slot, each its phase records in the order they were written."""
        ids = [c for (c,) in self._all("SELECT cycle_id FROM cycles GROUP BY cycle_id "
                                       "ORDER BY max(slot_ms) DESC, max(at_ms) DESC LIMIT ?", (limit,))]
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        by_id: dict[str, list[CycleRecord]] = {c: [] for c in ids}
        for (b,) in self._all(f"SELECT body FROM cycles WHERE cycle_id IN ({marks}) ORDER BY at_ms, rowid", ids):
            rec = decode(CycleRecord, b)
            by_id[rec.cycle_id].append(rec)
        return [by_id[c] for c in ids]

    def facets(self) -> dict[str, list[str]]:
        """The values the filters offer: collections and providers seen."""
        cols = [c for (c,) in self._all("SELECT DISTINCT collection FROM traces WHERE collection IS NOT NULL "
                                        "ORDER BY collection")]
        provs: set[str] = set()
        for (p,) in self._all("SELECT DISTINCT providers FROM traces"):
            provs.update(x for x in p.split("|") if x)
        return {"collections": cols, "providers": sorted(provs)}

    def counts(self) -> dict[str, int]:
        names = ("traces", "verdicts", "reviews", "adapters", "cycles")
        return {n: self._all(f"SELECT count(*) FROM {n}")[0][0] for n in names}
