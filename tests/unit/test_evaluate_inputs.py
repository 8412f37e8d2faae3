"""The best-single rule (training episodes only), the held-out split, and reading traces files."""

from __future__ import annotations

import pytest

from services.common.dataset import write_jsonl
from services.evaluate.baseline import NoBaseline, choose_best_single
from services.evaluate.inputs import EvalInputError, held_out, load_traces_file
from tests.support.records import candidate, episode, trace

P = ("a", "b", "c")


def test_best_single_is_the_most_often_top_tier_provider():
    eps = [episode("q1", "a > b > c", P), episode("q2", "b = a > c", P), episode("q3", "b > c > a", P),
           episode("q4", "a > c > b", P)]
    best = choose_best_single(eps)
    assert best.provider == "a"  # top tier in 3 of 4 (q1, q2 tied, q4); b in 2
    rows = {r.provider: r for r in best.table}
    assert rows["a"].top_share == 0.75 and rows["b"].top_share == 0.5
    assert rows["a"].mean_position == pytest.approx((0 + 0.5 + 2 + 0) / 4)  # a tie shares positions 0 and 1
    assert best.episodes_used == 4 and "top tier" in best.rule


def test_best_single_ties_break_by_mean_position_then_name():
    # Top tier once each; b's mean position (1 + 0) / 2 beats a's (0 + 2) / 2.
    assert choose_best_single([episode("q1", "a > b > c", P), episode("q2", "b > c > a", P)]).provider == "b"
    # Equal share (2 of 3) and equal mean position (1.5 / 3): by name.
    eps = [episode("q1", "a = b > c", P), episode("q2", "a > b > c", P), episode("q3", "b > a > c", P)]
    assert [r.provider for r in choose_best_single(eps).table] == ["a", "b", "c"]


def test_best_single_skips_unreadable_orderings_and_counts_them():
    eps = [episode("q1", "I think b", P), episode("q2", "c > a > b", P)]
    best = choose_best_single(eps)
    assert best.provider == "c" and best.episodes_unreadable == 1
    with pytest.raises(NoBaseline):
        choose_best_single([episode("q1", "no idea", P)])


def test_held_out_excludes_trained_queries_routed_traces_and_duplicates():
    eps = [episode("What is  a Cell", "a > b", P)]
    traces = [trace("t1", [candidate("a")], query="what is a cell"),  # same query, normalised
              trace("t2", [candidate("a")], query="boundary layers"),
              trace("t2", [candidate("a")], query="boundary layers"),  # replayed record
              trace("t3", [candidate("a")], query="x", mode="routed"),
              trace("t4", [candidate("b")], query="y")]
    h = held_out(traces, eps, require="a")
    assert [t.trace_id for t in h.traces] == ["t2"]
    assert h.read == 5
    assert h.excluded == {"not_fanout": 1, "duplicate_trace_id": 1, "trained_query": 1, "missing_best_single": 1}


def test_held_out_traces_come_in_query_order_whatever_their_arrival():
    """The paired bootstrap resamples positions: arrival order (concurrent replay) must not move its interval."""
    import random

    from services.evaluate.metrics import paired
    from services.evaluate.policies import Outcome

    traces = [trace(f"t{i}", [candidate("a")], query=f"query {i:02d}") for i in range(30)]
    shuffled = traces[:]
    random.Random(1).shuffle(shuffled)
    a, b = held_out(traces, [], require="a").traces, held_out(shuffled, [], require="a").traces
    assert [t.trace_id for t in a] == [t.trace_id for t in b] == [t.trace_id for t in traces]

    def outcomes(kept, grade):
        return [Outcome(policy="p", called=("a",), returned="a", cost_usd=0.001, latency_ms=1.0,
                        human=grade(t), judge=grade(t)) for t in kept]

    def score(t):
        return int(t.trace_id[1:]) * 7 % 30 / 29  # 30 distinct values: another order moves the percentiles

    base = [Outcome(policy="q", called=("a",), returned="a", cost_usd=0.001, latency_ms=1.0, human=0.5, judge=0.5)
            for _ in traces]
    assert paired("p", "q", "human", outcomes(a, score), base) == paired("p", "q", "human", outcomes(b, score), base)
    arrival = paired("p", "q", "human", outcomes(shuffled, score), base)  # what the bootstrap saw before
    assert arrival.mean_diff == paired("p", "q", "human", outcomes(a, score), base).mean_diff
    assert arrival.ci95 != paired("p", "q", "human", outcomes(a, score), base).ci95


def test_traces_file_errors_name_the_file_and_line(tmp_path):
    good = tmp_path / "t.jsonl"
    write_jsonl([trace("t1", [candidate("a")]), trace("t2", [candidate("a")])], good)
    assert [t.trace_id for t in load_traces_file(good)] == ["t1", "t2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.read_bytes() + b"\n{\"trace_id\": 1}\n")
    with pytest.raises(EvalInputError, match=r"bad\.jsonl:4: not a trace"):
        load_traces_file(bad)
    with pytest.raises(EvalInputError, match="does not exist"):
        load_traces_file(tmp_path / "nope.jsonl")
