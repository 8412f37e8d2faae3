"""Counting what a fault test produced, and reporting its row of the fault matrix (docs/faults.md).

A row counts the records the consumer was given and the results it produced, both by record and
by content-derived id: ``duplicates`` are result records beyond one per id, ``lost`` are expected
ids with no result, ``unexpected`` are result ids nobody asked for. :func:`exactly_once` reports the
row first (so a failing run's counts are kept too), then fails the test on any loss or duplicate.

Rows are printed (``pytest -s`` shows them) and, when ``FANROUTE_FAULT_MATRIX_OUT`` names a file,
appended to it as one JSON object per line (``python -m tests.support.fault_matrix FILE`` renders
them as docs/faults.md's table).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

OUT_ENV = "FANROUTE_FAULT_MATRIX_OUT"


@dataclass(frozen=True)
class Row:
    """One fault, one consumer: what went in and what came out."""

    fault: str
    consumer: str
    test: str
    records_in: int
    results_out: int  # result records, duplicates included
    distinct: int  # distinct result ids
    duplicates: int
    lost: int
    unexpected: int
    extra: dict[str, object] = field(default_factory=dict)


def test_id(request) -> str:
    """``<file>::<test>`` of the running test (``request`` is pytest's fixture): a row's test column."""
    return request.node.nodeid.rsplit("/", 1)[-1]


test_id.__test__ = False  # not a test, whatever its name


def count(fault: str, consumer: str, test: str, *, records_in: int, expected: Collection[str],
          results: Iterable[str], **extra: object) -> Row:
    """The row for ``results`` (one content-derived id per result record) against the ``expected`` ids."""
    got = list(results)
    ids = Counter(got)
    want = set(expected)
    return Row(fault=fault, consumer=consumer, test=test, records_in=records_in, results_out=len(got),
               distinct=len(ids), duplicates=sum(n - 1 for n in ids.values()), lost=len(want - ids.keys()),
               unexpected=len(ids.keys() - want), extra=dict(extra))


def report(row: Row) -> Row:
    """Print ``row`` and append it to ``$FANROUTE_FAULT_MATRIX_OUT`` when that is set."""
    line = json.dumps(asdict(row), sort_keys=True)
    print(f"fault-matrix: {line}", file=sys.stderr)
    out = os.environ.get(OUT_ENV)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return row


def exactly_once(fault: str, consumer: str, test: str, *, records_in: int, expected: Collection[str],
                 results: Iterable[str], **extra: object) -> Row:
    """Count and report the row, then fail unless every expected id has exactly one result record."""
    row = report(count(fault, consumer, test, records_in=records_in, expected=expected, results=results,
                       **extra))
    assert row.lost == 0, f"{row.lost} lost: {row}"
    assert row.duplicates == 0, f"{row.duplicates} duplicated: {row}"
    assert row.unexpected == 0, f"{row.unexpected} unexpected results: {row}"
    return row


def table(rows: Iterable[dict]) -> str:
    """The README's fault-matrix table (Markdown) from reported rows (the last run of each test wins)."""
    last = {(r["test"], r["consumer"]): r for r in rows}
    lines = ["| fault | consumer | records in | results out (distinct) | duplicates | lost | test |",
             "|---|---|---|---|---|---|---|"]
    for r in last.values():
        lines.append(f"| {r['fault']} | {r['consumer']} | {r['records_in']} | {r['results_out']} "
                     f"({r['distinct']}) | {r['duplicates']} | {r['lost']} | `{r['test']}` |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()))
