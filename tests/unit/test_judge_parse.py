"""parse_judgement: reads the judge's JSON out of whatever the model wrapped it in, strictly."""

from __future__ import annotations

import json

import pytest

from services.judge.base import JudgeFailed
from services.judge.parse import parse_judgement

ABC = ("A", "B", "C")
GOOD = '{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}'


def reason(text: str, letters: tuple[str, ...] = ABC) -> str:
    """The failure message for ``text`` (which must fail)."""
    with pytest.raises(JudgeFailed) as info:
        parse_judgement(text, letters)
    return str(info.value)


def test_plain_json() -> None:
    result = parse_judgement(GOOD, ABC)
    assert result.grades == {"A": 3, "B": 1, "C": 1}
    assert result.ordering == (("A",), ("B", "C"))
    assert result.raw == GOOD


def test_code_fence_and_prose_around_it() -> None:
    text = f"Sure! Here is my judgement:\n```json\n{GOOD}\n```\nLet me know if you need more."
    result = parse_judgement(text, ABC)
    assert result.ordering == (("A",), ("B", "C"))
    assert result.raw == text


def test_skips_braces_and_objects_without_grades() -> None:
    text = ('Notes {not json} and {"thinking": "B {and} C tie"} then\n'
            '{"grades": {"A": 2, "B": 2, "C": 0}, "ranking": [["A", "B"], ["C"]]} done {')
    result = parse_judgement(text, ABC)
    assert result.grades == {"A": 2, "B": 2, "C": 0}
    assert result.ordering == (("A", "B"), ("C",))


def test_first_object_with_grades_wins() -> None:
    second = '{"grades": {"A": 0, "B": 0, "C": 0}, "ranking": [["A", "B", "C"]]}'
    assert parse_judgement(GOOD + "\n" + second, ABC).grades["A"] == 3


def test_nested_strings_with_braces_parse() -> None:
    text = json.dumps({"note": "} tricky {", "grades": {"A": 1, "B": 0, "C": 3},
                       "ranking": [["C"], ["A"], ["B"]]})
    assert parse_judgement(text, ABC).ordering == (("C",), ("A",), ("B",))


def test_digit_strings_and_whole_floats_are_grades() -> None:
    text = '{"grades": {"A": "3", "B": " 0 ", "C": 2.0}, "ranking": [["A"], ["C"], ["B"]]}'
    assert parse_judgement(text, ABC).grades == {"A": 3, "B": 0, "C": 2}


def test_single_letter_tiers() -> None:
    text = '{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": ["A", ["B", "C"]]}'
    assert parse_judgement(text, ABC).ordering == (("A",), ("B", "C"))


def test_letters_are_case_insensitive_and_upper_cased() -> None:
    text = '{"grades": {"a": 3, "b": 1, "C": 1}, "ranking": [["a"], ["B", "c"]]}'
    result = parse_judgement(text, ("a", "B", "C"))
    assert result.grades == {"A": 3, "B": 1, "C": 1}
    assert result.ordering == (("A",), ("B", "C"))


def test_empty_tiers_are_dropped() -> None:
    text = '{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [[], ["A"], ["B", "C"]]}'
    assert parse_judgement(text, ABC).ordering == (("A",), ("B", "C"))


def test_no_candidates() -> None:
    result = parse_judgement('{"grades": {}, "ranking": []}', ())
    assert result.grades == {} and result.ordering == ()


@pytest.mark.parametrize("text, expected", [
    ("", "empty"),
    ("I think A is best, then B and C.", "no JSON object with 'grades'"),
    ('```json\n{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B" "C"]]}\n```',
     "no JSON object with 'grades'"),
    ('{"ranking": [["A"], ["B", "C"]]}', "no JSON object with 'grades'"),
    ('{"grades": [3, 1, 1], "ranking": [["A"], ["B", "C"]]}', "'grades' is list"),
    ('{"grades": {"A": 4, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is 4, outside 0-3"),
    ('{"grades": {"A": -1, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is -1"),
    ('{"grades": {"A": 2.5, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}',
     "grade for A is 2.5, not an integer"),
    ('{"grades": {"A": "2.5", "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is '2.5'"),
    ('{"grades": {"A": "high", "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is 'high'"),
    ('{"grades": {"A": true, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is true"),
    ('{"grades": {"A": null, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "grade for A is null"),
    ('{"grades": {"A": 3, "B": 1}, "ranking": [["A"], ["B", "C"]]}', "no grade for C"),
    ('{"grades": {"A": 3, "B": 1, "C": 1, "D": 0}, "ranking": [["A"], ["B", "C"]]}', "unknown letter 'D'"),
    ('{"grades": {"A": 3, "a": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C"]]}', "A is graded twice"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}}', "no 'ranking'"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": "A > B = C"}', "'ranking' is str"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B", "A"], ["C"]]}',
     "letter A appears twice in the ranking"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B"]]}', "ranking misses C"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], ["B", "C", "E"]]}',
     "ranking tier 2 has unknown letter 'E'"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], {"B": 1, "C": 2}]}',
     "ranking tier 2 is dict"),
    ('{"grades": {"A": 3, "B": 1, "C": 1}, "ranking": [["A"], [1, "C"]]}',
     "ranking tier 2 has 1, not a letter"),
])
def test_failures_say_why(text: str, expected: str) -> None:
    assert expected in reason(text)


def test_never_clamps_or_fills_in() -> None:
    """A bad grade is never turned into a valid one, however close it is."""
    for bad in ("3.5", "4", "-0.5", '"03.0"'):
        text = f'{{"grades": {{"A": {bad}, "B": 1, "C": 1}}, "ranking": [["A"], ["B", "C"]]}}'
        with pytest.raises(JudgeFailed):
            parse_judgement(text, ABC)


def test_long_garbage_is_summarised() -> None:
    message = reason("no json " * 500)
    assert "4000 chars" in message and len(message) < 200
