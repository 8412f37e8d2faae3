"""The router reply parser: what small models write around an ordering, and when there is none."""

from __future__ import annotations

import pytest

from services.router.parse import UnparseableOrdering, parse_ordering

P = ("bm25-all", "dense-all", "bio-dense", "lib-bm25", "eng-bm25")


@pytest.mark.parametrize("text, tiers", [
    ("bm25-all > dense-all > bio-dense > lib-bm25 > eng-bm25",
     [["bm25-all"], ["dense-all"], ["bio-dense"], ["lib-bm25"], ["eng-bm25"]]),
    ("```\nbio-dense > bm25-all\n```", [["bio-dense"], ["bm25-all"]]),
    ("```text\nlib-bm25 > eng-bm25\n```\n", [["lib-bm25"], ["eng-bm25"]]),
    ("Sure! The best provider is bio-dense. Here is the ordering: bio-dense > bm25-all > dense-all. Hope it helps.",
     [["bio-dense"], ["bm25-all"], ["dense-all"]]),
    ("Ranking:\n1. lib-bm25\n2. bm25-all\n3. eng-bm25", [["lib-bm25"], ["bm25-all"], ["eng-bm25"]]),
    ("- dense-all\n- bm25-all", [["dense-all"], ["bm25-all"]]),
    ('["dense-all", ["bm25-all", "bio-dense"], "eng-bm25"]',
     [["dense-all"], ["bm25-all", "bio-dense"], ["eng-bm25"]]),
    ('{"ordering": ["eng-bm25", "lib-bm25"]}', [["eng-bm25"], ["lib-bm25"]]),
    ("bm25-all = dense-all > eng-bm25", [["bm25-all", "dense-all"], ["eng-bm25"]]),
    ("bm25-all, dense-all and bio-dense", [["bm25-all"], ["dense-all"], ["bio-dense"]]),
    ("BIO-DENSE > Bm25-All", [["bio-dense"], ["bm25-all"]]),
    ("bm25-all -> dense-all", [["bm25-all"], ["dense-all"]]),
    ("bm25-all > bm25-all > dense-all", [["bm25-all"], ["dense-all"]]),  # a repeat counts once
    ("<think>dense-all > bm25-all</think>lib-bm25 > eng-bm25", [["lib-bm25"], ["eng-bm25"]]),
])
def test_orderings_are_read_out_of_what_small_models_write(text, tiers):
    assert [list(t) for t in parse_ordering(text, P).tiers] == tiers


def test_unknown_names_are_dropped_and_reported_and_missing_ones_listed():
    parsed = parse_ordering("bm25-all > google > dense-all = bio-dense", P)
    assert parsed.tiers == (("bm25-all",), ("dense-all", "bio-dense"))
    assert parsed.ordering == ("bm25-all", "dense-all", "bio-dense")
    assert parsed.unknown == ("google",)
    assert parsed.missing == ("lib-bm25", "eng-bm25")


def test_a_name_inside_a_longer_word_is_not_that_name():
    parsed = parse_ordering("bm25-allx > dense-all", P)
    assert parsed.ordering == ("dense-all",) and parsed.unknown == ("bm25-allx",)
    # the longer of two overlapping names wins
    assert parse_ordering("bm25-all > bm25", ("bm25", "bm25-all")).ordering == ("bm25-all", "bm25")


@pytest.mark.parametrize("text", ["", "I don't know", "bm25 > dense", "```\n\n```", "google > bing"])
def test_no_known_name_is_unparseable(text):
    with pytest.raises(UnparseableOrdering, match="no known provider") as info:
        parse_ordering(text, P)
    assert isinstance(info.value, ValueError)  # callers that only know the standard library


def test_no_providers_is_a_programming_error():
    with pytest.raises(ValueError, match="at least one provider"):
        parse_ordering("bm25-all", ())
