"""The fan-out slice (deterministic, the configured share) and the order providers are tried in."""

from __future__ import annotations

import pytest

from services.router.policy import call_order, in_fanout_slice

KEYS = [f"req-{i}" for i in range(10_000)]


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 0.9])
def test_slice_is_the_configured_share_of_keys(fraction):
    share = sum(in_fanout_slice(k, fraction) for k in KEYS) / len(KEYS)
    assert share == pytest.approx(fraction, abs=0.015)


def test_slice_is_deterministic_and_nested():
    first = [in_fanout_slice(k, 0.1) for k in KEYS]
    assert first == [in_fanout_slice(k, 0.1) for k in KEYS]
    # a bigger fraction keeps every key the smaller one had (raising it only adds queries)
    assert all(in_fanout_slice(k, 0.3) for k, inside in zip(KEYS, first) if inside)


@pytest.mark.parametrize("fraction, expected", [(0.0, False), (-1.0, False), (1.0, True), (2.0, True)])
def test_slice_edges(fraction, expected):
    assert {in_fanout_slice(k, fraction) for k in KEYS[:500]} == {expected}


@pytest.mark.parametrize("ordering, fallback, expected", [
    (("b", "a"), None, ["b", "a", "c"]),
    (("b",), "c", ["b", "c", "a"]),
    ((), "c", ["c", "a", "b"]),
    ((), None, ["a", "b", "c"]),
    (("x", "b", "b"), "y", ["b", "a", "c"]),  # unknown names and an unknown fallback are ignored
    (("c", "b", "a"), "a", ["c", "b", "a"]),
])
def test_call_order(ordering, fallback, expected):
    assert call_order(ordering, ("a", "b", "c"), fallback) == expected
