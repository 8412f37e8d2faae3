"""Judge calibration: tau-b (checked against scipy), top-1, qrels-derived grades, hand-ranking files."""

from __future__ import annotations

import csv
import math
import random

import pytest
import scipy.stats as scipy_stats  # noqa: E402  (dev dependency: the reference for tau-b)

from schemas import Candidate, Trace
from services.common.errors import ConfigError
from services.common.ir import ndcg_at_k
from services.judge.calibration.files import (
    RANKING_COLUMN,
    default_key_path,
    export_blind,
    import_rankings,
    letter_names,
    parse_ranking,
    read_key,
)
from services.judge.calibration.human import (
    NDCG_CUTS,
    QrelsStore,
    human_grades,
    ndcg_grade,
    ranked_doc_ids,
    tiers_by_value,
)
from services.judge.calibration.metrics import (
    TracePair,
    agreement_report,
    kendall_tau_b,
    render_report,
    restrict,
    tier_scores,
    tiers_tau,
    top1_agreement,
)
from services.providers.collections import (
    default_collections_dir,
    load_corpus,
    load_qrels,
)
from tests.support.records import candidate, trace

# --------------------------------------------------------------------------- tau-b


@pytest.mark.parametrize("seed", range(40))
def test_tau_b_matches_scipy_on_tied_data(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 30)
    levels_x, levels_y = rng.randint(1, 5), rng.randint(1, 5)
    x = [rng.randint(0, levels_x) for _ in range(n)]
    y = [rng.randint(0, levels_y) if rng.random() < 0.7 else x[i] for i in range(n)]
    ours = kendall_tau_b(x, y)
    theirs = scipy_stats.kendalltau(x, y, variant="b").statistic
    if math.isnan(theirs):
        assert math.isnan(ours)
    else:
        assert ours == pytest.approx(theirs, abs=1e-12)


def test_tau_b_edge_cases():
    assert kendall_tau_b([1, 2, 3], [1, 2, 3]) == 1.0
    assert kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1.0
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))  # one side all ties: undefined
    assert math.isnan(kendall_tau_b([1, 2], [5, 5]))
    assert math.isnan(kendall_tau_b([1], [1])) and math.isnan(kendall_tau_b([], []))
    assert math.isnan(scipy_stats.kendalltau([1, 1, 1], [1, 2, 3], variant="b").statistic)
    with pytest.raises(ValueError, match="length"):
        kendall_tau_b([1, 2], [1])


def test_tiers_helpers():
    tiers = (("a",), ("b", "c"), ("d",))
    assert tier_scores(tiers) == {"a": 0, "b": -1, "c": -1, "d": -2}
    assert restrict(tiers, {"b", "c", "d"}) == (("b", "c"), ("d",))
    assert restrict(tiers, {"a", "d"}) == (("a",), ("d",))
    assert tiers_tau(tiers, tiers) == 1.0
    assert tiers_tau((("d",), ("b", "c"), ("a",)), tiers) == -1.0
    assert math.isnan(tiers_tau((("a", "b", "c", "d"),), tiers))
    # Only shared names count: "x" and "y" are ignored.
    assert tiers_tau((("a", "x"), ("d",)), (("y",), ("a",), ("d",))) == 1.0


# --------------------------------------------------------------------------- top-1


def test_top1_agreement_definition():
    assert top1_agreement((("a",), ("b",)), (("a",), ("b",)))
    assert not top1_agreement((("b",), ("a",)), (("a",), ("b",)))
    # Top tiers intersect: a tie on either side is enough.
    assert top1_agreement((("a", "b"), ("c",)), (("b",), ("a", "c")))
    assert top1_agreement((("c",), ("a", "b")), (("a", "b", "c"),))
    assert not top1_agreement((("a", "b"), ("c",)), (("c",), ("a", "b")))
    # Names one side lacks are dropped first: the judge's best shared name is "b".
    assert top1_agreement((("x",), ("b",), ("a",)), (("b",), ("a",)))
    assert not top1_agreement((("x",),), (("y",),))
    assert not top1_agreement((), (("a",),))


def test_agreement_report_counts_and_bias():
    pairs = [
        TracePair("t1", (("a",), ("b",), ("c",)), (("a",), ("b",), ("c",))),   # tau 1, top-1 yes
        TracePair("t2", (("a",), ("b", "c")), (("b",), ("a",), ("c",))),       # top-1 no
        TracePair("t3", (("a",), ("b", "c")), (("a", "b", "c"),)),              # human all tied
        TracePair("t4", (("a", "b", "c"),), (("c",), ("a", "b"))),              # judge all tied
        TracePair("t5", (("z",),), (("y",),)),                                  # nothing shared
    ]
    rep = agreement_report(pairs)
    o = rep.overall
    assert (o.n, o.n_informative, o.n_tau) == (4, 3, 2)
    tau2 = tiers_tau(pairs[1].judge, pairs[1].human)
    assert o.tau == pytest.approx((1.0 + tau2) / 2)
    assert o.tau_informative == pytest.approx((1.0 + tau2 + 0.0) / 3)
    assert o.top1 == pytest.approx(2 / 3)  # t1 yes, t2 no, t4 yes (tied judge intersects)
    assert o.top1_all == pytest.approx(3 / 4)
    a = rep.per_provider["a"]
    assert (a.n, a.n_pairs) == (4, 8)
    assert a.judge_top == 1.0 and a.human_top == pytest.approx(2 / 4)
    assert a.both_top == pytest.approx(2 / 4)
    assert a.lift > 0  # the judge puts "a" above its rivals more often than the humans do
    assert rep.per_provider["c"].lift < 0
    assert set(rep.per_provider) == {"a", "b", "c"}
    text = render_report(rep, "test")
    assert "test: 4 traces" in text and "\n  a " in text


def test_agreement_report_of_nothing():
    o = agreement_report([]).overall
    assert o.n == 0 and math.isnan(o.tau) and math.isnan(o.top1)


# --------------------------------------------------------------------------- human grades


def _trace(query_id: str | None, cands, trace_id: str = "t1") -> Trace:
    return trace(trace_id, cands, query="q", query_id=query_id)


def _urls(collection: str, ids) -> tuple[str, ...]:
    return tuple(f"collection://{collection}/{d}" for d in ids)


@pytest.fixture(scope="module")
def adi():
    """An ADI query with at least three relevant docs, those docs, and ten judged-irrelevant ones."""
    cdir = default_collections_dir()
    qrels = load_qrels(cdir, "adi")
    qid, judged = next((q, j) for q, j in sorted(qrels.items(), key=lambda x: int(x[0]))
                       if sum(g > 0 for g in j.values()) >= 3)
    rel = sorted((d for d, g in judged.items() if g > 0), key=int)
    irrelevant = [d.doc_id for d in load_corpus(cdir, "adi") if d.doc_id not in judged][:10]
    return qid, judged, rel, irrelevant


def test_human_grades_on_real_qrels(adi):
    qid, judged, rel, irr = adi
    cands = [
        candidate("perfect", _urls("adi", rel)),
        candidate("bad", _urls("adi", irr)),
        candidate("mixed", _urls("adi", irr[:4] + rel[:1] + irr[4:9])),
        # Same numeric ids in another collection: never a match (cisi/12 is not adi/12).
        candidate("impostor", _urls("cisi", rel)),
        Candidate(provider="failed", latency_ms=5, cost_usd=0, error="boom", error_kind="timeout"),
    ]
    h = human_grades(_trace(f"adi/{qid}", cands), QrelsStore())
    assert h is not None and (h.collection, h.query_id) == ("adi", qid)
    assert h.ndcg["perfect"] == pytest.approx(1.0) and h.grades["perfect"] == 3
    mixed = ndcg_at_k(list(irr[:4] + rel[:1] + irr[4:9]), judged)
    assert h.ndcg["mixed"] == pytest.approx(mixed) and 0 < mixed < NDCG_CUTS[0]
    assert h.grades["mixed"] == 1
    for name in ("bad", "impostor", "failed"):
        assert h.ndcg[name] == 0.0 and h.grades[name] == 0
    assert h.ordering == (("perfect",), ("mixed",), ("bad", "failed", "impostor"))


def test_human_grades_cut_points(adi):
    qid, judged, rel, irr = adi
    # A single relevant doc at rank 1 out of >= 3 relevant: nDCG between the cuts -> grade 2.
    one = candidate("one", _urls("adi", rel[:1] + irr[:9]))
    h = human_grades(_trace(f"adi/{qid}", [one]), QrelsStore())
    assert NDCG_CUTS[0] <= h.ndcg["one"] < NDCG_CUTS[1] and h.grades["one"] == 2
    assert [ndcg_grade(v) for v in (0.0, 1e-9, 0.299, 0.3, 0.599, 0.6, 1.0)] == [0, 1, 1, 2, 2, 3, 3]


def test_traces_without_qrels_have_no_human_grades():
    store = QrelsStore()
    cands = [candidate("a", _urls("adi", ["1"]))]
    assert human_grades(_trace(None, cands), store) is None
    assert human_grades(_trace("web/123", cands), store) is None
    assert human_grades(_trace("adi/no-such-query", cands), store) is None
    assert human_grades(_trace("adi/", cands), store) is None


def test_ranked_doc_ids_never_cross_collections():
    urls = ["collection://adi/12", "collection://cisi/12", "https://x.org/12", "collection://adi",
            "collection://adi/a%2Fb"]
    ids = ranked_doc_ids(urls, "adi")
    assert ids[0] == "12" and ids[4] == "a/b"
    assert all(i.startswith("\0") for i in ids[1:4])


def test_tiers_by_value_ties_exact_values():
    assert tiers_by_value({"a": 0.5, "b": 0.1 + 0.2 + 0.2, "c": 0.0, "d": 0.0}) == (
        ("a", "b"), ("c", "d"))


# --------------------------------------------------------------------------- files


def _traces(n: int = 6) -> list[Trace]:
    """Traces of three providers citing two docs each (so CSV cells span lines); trace-0 adds a failure."""
    out = []
    for i in range(n):
        cands = [candidate(p, _urls("adi", [str(j + 1), str(j + 10)])).model_copy(
                     update={"answer": f"answer by {p}"})
                 for j, p in enumerate(("bm25-all", "dense-all", "bio-dense"))]
        if i == 0:
            cands.append(Candidate(provider="brave", latency_ms=1, cost_usd=0,
                                   error="brave: HTTP 500", error_kind="http_error"))
        out.append(_trace(f"adi/{i}", cands, trace_id=f"trace-{i}"))
    return out


def _read(path):
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _write(path, rows):
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_export_is_blind_and_deterministic(tmp_path):
    traces = _traces()
    out, key = export_blind(traces, tmp_path / "rank.csv", n=4, seed=7)
    assert key == default_key_path(out) == tmp_path / "rank.key.csv"
    text = out.read_text()
    for leak in ("bm25", "dense", "brave", "collection://", "HTTP 500", "answer by"):
        assert leak not in text
    rows = _read(out)
    assert len(rows) == 4 and all(r[RANKING_COLUMN] == "" for r in rows)
    assert list(rows[0]) == ["trace_id", "query", "A", "B", "C", RANKING_COLUMN]
    keymap = read_key(key)
    assert set(keymap) == {r["trace_id"] for r in rows}
    again, _ = export_blind(traces, tmp_path / "again.csv", n=4, seed=7)
    assert again.read_bytes() == out.read_bytes()
    assert (tmp_path / "again.key.csv").read_bytes() == key.read_bytes()
    # Letters are shuffled per trace: across traces, "A" is not always the same provider.
    all_csv, key_all = export_blind(traces, tmp_path / "all.csv", n=100, seed=1)
    assert len({m["A"] for m in read_key(key_all).values()}) > 1
    # The widest trace (a failed 4th candidate) sets the columns; the failed one shows no answer.
    rows = _read(all_csv)
    assert list(rows[0]) == ["trace_id", "query", "A", "B", "C", "D", RANKING_COLUMN]
    assert "(no answer)" in [rows[0][x] for x in "ABCD"] and rows[1]["D"] == ""


def test_export_import_round_trip(tmp_path):
    traces = _traces()
    out, key = export_blind(traces, tmp_path / "rank.csv", n=6, seed=3)
    keymap = read_key(key)
    rows = _read(out)
    expected = {}
    for row in rows[:-1]:  # the last row is left unranked: skipped on import
        by_provider = {p: letter for letter, p in keymap[row["trace_id"]].items()}
        best, rest = by_provider["dense-all"], sorted(x for p, x in by_provider.items() if p != "dense-all")
        row[RANKING_COLUMN] = f"{best} > {' = '.join(rest)}".lower()
        expected[row["trace_id"]] = (("dense-all",), tuple(keymap[row["trace_id"]][x] for x in rest))
    _write(out, rows)
    assert import_rankings(out, key) == expected


def test_parse_ranking():
    assert parse_ranking("B > A = C", ["A", "B", "C"]) == (("B",), ("A", "C"))
    assert parse_ranking(" a=b=c ", ["A", "B", "C"]) == (("A", "B", "C"),)
    assert letter_names(3) == ["A", "B", "C"] and letter_names(28)[26:] == ["AA", "AB"]


@pytest.mark.parametrize(("ranking", "reason"), [
    ("B > A", "missing"),
    ("B > A = C = B", "appears twice"),
    ("B > > A = C", "empty place"),
    ("B > A = C >", "empty place"),
    ("B > A, C", "not a letter"),
    ("B > A = Z", "not one of this trace"),
    ("1 > 2 > 3", "not a letter"),
])
def test_malformed_rankings_name_line_and_reason(tmp_path, ranking, reason):
    out, key = export_blind(_traces(3), tmp_path / "rank.csv", n=3, seed=0)
    rows = _read(out)
    assert len(read_key(key)[rows[2]["trace_id"]]) == 3  # letters A, B, C
    for i, row in enumerate(rows):
        row[RANKING_COLUMN] = ranking if i == 2 else " > ".join(sorted(read_key(key)[row["trace_id"]]))
    _write(out, rows)
    # The record of the third trace starts on the line that holds its trace id (cells span lines).
    lines = out.read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith(rows[2]["trace_id"] + ","))
    assert line > 4  # records before it span several lines each
    with pytest.raises(ConfigError, match=rf"rank\.csv: line {line}: .*{reason}"):
        import_rankings(out, key)


def test_import_rejects_bad_files(tmp_path):
    out, key = export_blind(_traces(2), tmp_path / "rank.csv", n=2, seed=0)
    rows = _read(out)
    tid = rows[0]["trace_id"]
    letters = " > ".join(sorted(read_key(key)[tid]))
    # Unknown trace id.
    rows[0]["trace_id"], rows[0][RANKING_COLUMN] = "nope", letters
    _write(out, rows)
    with pytest.raises(ConfigError, match=r"line 2: trace 'nope' is not in the key"):
        import_rankings(out, key)
    # The same trace ranked twice.
    rows[0]["trace_id"] = rows[1]["trace_id"] = tid
    rows[1][RANKING_COLUMN] = letters
    _write(out, rows)
    with pytest.raises(ConfigError, match=r"is ranked twice"):
        import_rankings(out, key)
    # No ranking column.
    (tmp_path / "bare.csv").write_text("trace_id,query\nx,y\n")
    with pytest.raises(ConfigError, match=r"bare\.csv: line 1: missing column\(s\) ranking"):
        import_rankings(tmp_path / "bare.csv", key)
    # A key with a repeated letter.
    (tmp_path / "bad.key.csv").write_text("trace_id,letter,provider\nt,A,x\nt,A,y\n")
    with pytest.raises(ConfigError, match=r"bad\.key\.csv: line 3: letter A of trace t appears twice"):
        read_key(tmp_path / "bad.key.csv")
    (tmp_path / "short.key.csv").write_text("trace_id,letter,provider\nt,A,\n")
    with pytest.raises(ConfigError, match=r"line 2: .*required"):
        read_key(tmp_path / "short.key.csv")
