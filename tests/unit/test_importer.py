"""``fanroute import``: every export format's fixture, redaction, telemetry join, bad lines, exit codes."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.base import content_id
from schemas.episode import Episode
from services.common.errors import ConfigError
from services.importer.cli import add_parser, run
from services.importer.formats import FORMATS, Conversation, detect_format
from services.importer.redact import Redactor, redact_conversation
from services.importer.run import UNKNOWN_TIME, import_file
from services.importer.telemetry import read_telemetry

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "import"
EMAIL, PHONE = "jane.doe@example.com", "+1 415-555-0134"
KEY, AWS = "sk-proj-AbC123dEf456GhI789jKl012MnO345pQr", "AKIAIOSFODNN7EXAMPLE"
ALL = Redactor.build("all")
T1 = "1f0e2d3c-4b5a-4697-8877-665544332211"


def _expected() -> dict[str, tuple[str, list[tuple[str | None, list[tuple[str, str]]]]]]:
    """format -> (fixture, [(trace_id, [(role, content), ...]), ...]) as imported with every preset on."""
    cases = json.loads((FIX / "expected.json").read_text(encoding="utf-8"))
    return {fmt: (case["fixture"], [(ep["trace_id"], [tuple(m) for m in ep["messages"]]) for ep in case["episodes"]])
            for fmt, case in cases.items()}


CASES = _expected()

# format -> (malformed fixture, line of the bad record, good records kept by --skip-bad)
BAD = {
    "openai": ("openai_bad.jsonl", 2, 2),
    "anthropic": ("anthropic_bad.jsonl", 2, 2),
    "langsmith": ("langsmith_bad.jsonl", 2, 2),
    "vercel": ("vercel_bad.json", 52, 2),
    "csv": ("csv_bad.csv", 3, 2),
    "messages": ("messages_bad.jsonl", 2, 2),
}
# trace id -> scores in telemetry.jsonl, by format
JOINED = {
    "openai": {"chatcmpl-imp001": {"latency_s": 0.84, "thumbs_up": 1.0}, "chatcmpl-imp002": {"thumbs_up": 0.0}},
    "anthropic": {"msg_01imp001": {"csat": 4.5}},
    "langsmith": {T1: {"correctness": 0.8}},
    "vercel": {"chat-v5-001": {"thumbs_up": 1.0}},
    "csv": {"csv-001": {"ctr": 0.12}},
    "messages": {"msg-trace-3": {"thumbs_up": 0.0}},
}
FMTS = list(CASES)


def cli(*argv: object) -> int:
    """``fanroute import ...`` through the real argparse wiring."""
    parser = argparse.ArgumentParser(prog="fanroute")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    return run(parser.parse_args(["import", *map(str, argv)]))


def read_out(path: Path) -> list[Episode]:
    return [Episode.model_validate_json(line) for line in path.read_bytes().splitlines()]


def shape(episodes: list[Episode]) -> list[tuple[str | None, list[tuple[str, str]]]]:
    return [(ep.trace_id, [(m.role, m.content) for m in ep.messages]) for ep in episodes]


# --------------------------------------------------------------------------- per format

@pytest.mark.parametrize("fmt", FMTS)
def test_fixture_imports_to_expected_episodes(fmt):
    name, expected = CASES[fmt]
    result = import_file(FIX / name, fmt, redactor=ALL)
    assert shape(result.episodes) == expected
    assert result.errors == []
    assert all(ep.episode_id == content_id("import", fmt, ep.trace_id or [[m.role, m.content] for m in ep.messages])
               for ep in result.episodes)


@pytest.mark.parametrize("fmt", FMTS)
def test_auto_detects_the_format_and_gives_the_same_episodes(fmt):
    name, _ = CASES[fmt]
    assert detect_format(FIX / name) == fmt
    auto = import_file(FIX / name, "auto", redactor=ALL)
    assert auto.format == fmt
    assert auto.episodes == import_file(FIX / name, fmt, redactor=ALL).episodes


@pytest.mark.parametrize("fmt", FMTS)
def test_redaction_removes_every_secret_from_the_written_bytes(fmt, tmp_path, capsys):
    name, _ = CASES[fmt]
    raw = (FIX / name).read_text(encoding="utf-8")
    secrets = [s for s in (EMAIL, PHONE, KEY, AWS) if s in raw]
    assert {EMAIL, PHONE} <= set(secrets) and (KEY in secrets or AWS in secrets)

    assert cli(FIX / name, "--format", fmt, "--out", tmp_path / "plain.jsonl") == 0
    plain = (tmp_path / "plain.jsonl").read_text(encoding="utf-8")
    assert EMAIL in plain and PHONE in plain  # the control: without redaction they would leave

    assert cli(FIX / name, "--format", fmt, "--redact-preset", "email,phone,api_key",
               "--out", tmp_path / "out.jsonl") == 0
    written = (tmp_path / "out.jsonl").read_bytes()
    assert not [s for s in secrets if s.encode() in written]
    for kind in ("email", "phone", "api_key"):
        assert f"[REDACTED:{kind}]".encode() in written
    summary = capsys.readouterr().out
    assert "redactions            email 1, api_key 1, phone 1" in summary


@pytest.mark.parametrize("fmt", FMTS)
def test_telemetry_scores_join_as_reward_components_by_trace_id(fmt):
    name, _ = CASES[fmt]
    telemetry = read_telemetry(FIX / "telemetry.jsonl")
    result = import_file(FIX / name, fmt, redactor=ALL, telemetry=telemetry)
    got = {ep.trace_id: {r.name: r.value for r in ep.rewards} for ep in result.episodes if ep.rewards}
    assert got == JOINED[fmt]
    for ep in result.episodes:
        for reward in ep.rewards:
            assert reward.component_id == content_id(ep.episode_id, reward.name)
            assert reward.source == "telemetry:telemetry.jsonl"
    assert result.rewards_joined == sum(len(s) for s in JOINED[fmt].values())
    assert "trace-nobody" in result.unmatched_telemetry
    assert not set(JOINED[fmt]) & set(result.unmatched_telemetry)


@pytest.mark.parametrize("fmt", FMTS)
def test_reimport_gives_identical_ids_and_bytes(fmt, tmp_path):
    name, _ = CASES[fmt]
    args = (FIX / name, "--format", "auto", "--redact-preset", "all", "--telemetry", FIX / "telemetry.jsonl")
    assert cli(*args, "--out", tmp_path / "a.jsonl") == 0
    assert cli(*args, "--out", tmp_path / "b.jsonl") == 0
    first = (tmp_path / "a.jsonl").read_bytes()
    assert first == (tmp_path / "b.jsonl").read_bytes()
    assert first == b"".join(ep.to_bytes() + b"\n" for ep in read_out(tmp_path / "a.jsonl"))  # canonical


@pytest.mark.parametrize("fmt", FMTS)
def test_malformed_file_fails_naming_file_and_line_and_writes_nothing(fmt, tmp_path, capsys):
    name, line, _ = BAD[fmt]
    out = tmp_path / "out.jsonl"
    assert cli(FIX / name, "--format", fmt, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{FIX / name}:{line}: " in err
    assert f"(expected {FORMATS[fmt].expected})" in err
    assert "nothing written" in err and "--skip-bad" in err
    assert not out.exists()


@pytest.mark.parametrize("fmt", FMTS)
def test_skip_bad_keeps_the_good_lines(fmt, tmp_path, capsys):
    name, line, good = BAD[fmt]
    out = tmp_path / "out.jsonl"
    assert cli(FIX / name, "--format", fmt, "--skip-bad", "--out", out) == 0
    assert len(read_out(out)) == good
    summary = capsys.readouterr().out
    assert "bad lines dropped     1" in summary and f"{FIX / name}:{line}: " in summary


# --------------------------------------------------------------------------- format details

def test_created_at_comes_from_the_record_else_the_fixed_unknown_time():
    openai = import_file(FIX / "openai.jsonl", "openai", redactor=ALL).episodes
    assert openai[0].created_at == datetime.fromtimestamp(1718000000, UTC)
    assert openai[2].created_at == UNKNOWN_TIME
    vercel = import_file(FIX / "vercel.jsonl", "vercel", redactor=ALL).episodes
    assert vercel[1].created_at == datetime(2024, 6, 12, 8, 0, 7, tzinfo=UTC)


def test_skip_reasons_name_the_line():
    openai = import_file(FIX / "openai.jsonl", "openai", redactor=ALL)
    assert [(s.line, s.reason) for s in openai.skipped] == [(4, "no assistant turn with text")]
    langsmith = import_file(FIX / "langsmith.json", "langsmith", redactor=ALL)
    assert [(s.line, s.reason) for s in langsmith.skipped] == [
        (26, f"another run of trace {T1} is imported (line 2)"),
        (215, "run_type 'tool' (only llm and chain runs hold conversations)"),
    ]
    assert langsmith.conversations == 5


def test_meta_copied_along_is_redacted():
    conv = next(c for c in FORMATS["openai"].read(FIX / "openai.jsonl") if isinstance(c, Conversation))
    assert EMAIL in json.dumps(conv.meta)
    counts: Counter[str] = Counter()
    clean = redact_conversation(conv, ALL, counts)
    assert EMAIL not in json.dumps(clean.meta) and "[REDACTED:email]" in json.dumps(clean.meta)
    assert counts == Counter(email=1)  # counts are of the message text, what an episode carries


def test_vercel_bare_message_array_is_one_conversation(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
                                {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": "hello"}]}]))
    result = import_file(path, "auto", redactor=Redactor())
    assert result.format == "vercel"
    assert shape(result.episodes) == [("a1", [("user", "hi"), ("assistant", "hello")])]


def test_messages_json_array_of_conversations(tmp_path):
    path = tmp_path / "convs.json"
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    second = {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    path.write_text(json.dumps([first, second], indent=1))
    result = import_file(path, "auto", redactor=Redactor())
    assert result.format == "messages"
    assert shape(result.episodes) == [(None, [("user", "a"), ("assistant", "b")]),
                                      (None, [("user", "c"), ("assistant", "d")])]


def test_csv_query_response_header_and_a_missing_header(tmp_path):
    good = tmp_path / "qr.csv"
    good.write_text("query,response\nwhere is porto,in portugal\n")
    assert shape(import_file(good, "auto", redactor=Redactor()).episodes) == [
        (None, [("user", "where is porto"), ("assistant", "in portugal")])]
    bad = tmp_path / "noheader.csv"
    bad.write_text("where is porto,in portugal\n")
    with pytest.raises(ConfigError, match=rf"{bad}:1: header .* neither user,assistant nor query,response"):
        import_file(bad, "csv", redactor=Redactor())


def test_invalid_json_document_is_fatal_with_its_line(tmp_path, capsys):
    path = tmp_path / "runs.json"
    path.write_text('[\n  {"run_type": "llm"},\n  {oops}\n]\n')
    assert cli(path, "--format", "langsmith", "--skip-bad", "--out", tmp_path / "o.jsonl") == 2
    err = capsys.readouterr().err
    assert f"{path}:3: not valid JSON" in err and "expected LangSmith runs" in err


def test_system_prompt_is_added_only_where_there_is_none():
    result = import_file(FIX / "messages.jsonl", "messages", redactor=ALL, system_prompt="Route it.")
    assert [ep.messages[0].content for ep in result.episodes] == ["Be brief.", "Route it.", "Route it."]


def test_line_numbers_count_newlines_only(tmp_path):
    path = tmp_path / "sep.jsonl"
    ok = json.dumps([{"role": "user", "content": "a\u2028b\x85c"}, {"role": "assistant", "content": "d"}],
                    ensure_ascii=False)
    path.write_text(f"{ok}\n{{broken\n", encoding="utf-8")
    result = import_file(path, "messages", redactor=Redactor())
    assert shape(result.episodes) == [(None, [("user", "a\u2028b\x85c"), ("assistant", "d")])]
    assert [e.line for e in result.errors] == [2]


def test_same_conversation_twice_is_one_episode(tmp_path):
    line = json.dumps([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    path = tmp_path / "dup.jsonl"
    path.write_text(f"{line}\n{line}\n")
    result = import_file(path, "messages", redactor=Redactor())
    assert len(result.episodes) == 1
    assert [(s.line, s.reason) for s in result.skipped] == [(2, "same episode as line 1")]


# --------------------------------------------------------------------------- redaction, telemetry, CLI

@pytest.mark.parametrize(("text", "redacted"), [
    ("write to jane.doe@example.com.", "write to [REDACTED:email]."),
    ("call (415) 555-0134 or +44 20 7946 0958 or +14155550134",
     "call [REDACTED:phone] or [REDACTED:phone] or [REDACTED:phone]"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abcDEF123.xyz", "Authorization: Bearer [REDACTED:api_key]"),
    ("api_key=abcd1234efgh", "api_key=[REDACTED:api_key]"),
    ("sha 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "sha [REDACTED:api_key]"),
    ("aws wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY1234", "aws [REDACTED:api_key]"),
    ("card 4111 1111 1111 1111, not 4111 1111 1111 1112", "card [REDACTED:credit_card], not 4111 1111 1111 1112"),
    ("host 192.168.0.12", "host [REDACTED:ipv4]"),
    ("on 2024-01-15 or 15.01.2024, 1 000 000 people, pi 3.14159, id 123e4567-e89b-12d3-a456-426614174000",
     "on 2024-01-15 or 15.01.2024, 1 000 000 people, pi 3.14159, id 123e4567-e89b-12d3-a456-426614174000"),
])
def test_presets(text, redacted):
    assert ALL.redact(text) == redacted


def test_user_rules_run_first_and_may_redact_a_group():
    redactor = Redactor.build("email", ["ticket=TCK-\\d+", "pin=pin (?P<secret>\\d{4})"])
    counts: Counter[str] = Counter()
    assert redactor.redact("TCK-123 pin 1234 to a@b.io", counts) == \
        "[REDACTED:ticket] pin [REDACTED:pin] to [REDACTED:email]"
    assert counts == Counter(ticket=1, pin=1, email=1)
    assert redactor.kinds == ["ticket", "pin", "email"]


@pytest.mark.parametrize("custom", ["noequals", "bad name=x", "x=(unclosed", "x=a*"])
def test_bad_user_rules_are_config_errors(custom):
    with pytest.raises(ConfigError, match="--redact"):
        Redactor.build((), [custom])


def test_telemetry_reader_takes_both_line_shapes_and_reports_bad_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([
        '{"trace_id": "a", "scores": {"x": 1, "y": 0.5}}',
        '{"trace_id": "a", "name": "z", "value": 2}',
        '{"trace_id": "a", "name": "x", "value": 3}',
        '{"trace_id": "b", "scores": {"x": "high"}}',
        '{"scores": {"x": 1}}',
        'not json',
    ]) + "\n")
    telemetry = read_telemetry(path)
    assert telemetry.scores == {"a": {"x": 1.0, "y": 0.5, "z": 2.0}}
    assert [(e.line, e.message) for e in telemetry.errors] == [
        (3, "score 'x' of trace a was 1.0 on line 1, now 3.0"),
        (4, "score 'x' is 'high', not a finite number"),
        (5, 'no "trace_id" string'),
        (6, "not valid JSON (Expecting value at column 1)"),
    ]
    assert telemetry.source == "telemetry:t.jsonl"


def test_bad_telemetry_line_fails_the_import_unless_skip_bad(tmp_path, capsys):
    tel = tmp_path / "scores.jsonl"
    tel.write_text('{"trace_id": "chatcmpl-imp001", "scores": {"thumbs_up": 1}}\n{"trace_id": 5}\n')
    args = (FIX / "openai.jsonl", "--telemetry", tel, "--out", tmp_path / "o.jsonl")
    assert cli(*args) == 2
    assert f"{tel}:2: " in capsys.readouterr().err
    assert cli(*args, "--skip-bad") == 0
    assert sum(len(ep.rewards) for ep in read_out(tmp_path / "o.jsonl")) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--redact-preset", "email,passport"], "unknown redaction preset(s) passport"),
    (["--redact", "x=("], "not a valid regex"),
    (["--format", "auto"], "cannot tell the format"),
])
def test_cli_bad_configuration_exits_2(argv, message, tmp_path, capsys):
    odd = tmp_path / "odd.json"
    odd.write_text('{"hello": "world"}')
    assert cli(odd, *argv, "--out", tmp_path / "o.jsonl") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert cli(tmp_path / "nope.jsonl", "--format", "openai", "--out", tmp_path / "o.jsonl") == 2
    assert f"{tmp_path / 'nope.jsonl'}: cannot read" in capsys.readouterr().err


def test_cli_summary(tmp_path, capsys):
    assert cli(FIX / "openai.jsonl", "--redact-preset", "all", "--telemetry", FIX / "telemetry.jsonl",
               "--out", tmp_path / "o.jsonl") == 0
    out = capsys.readouterr().out
    for line in ("conversations read    4", "episodes written      3", "skipped               1",
                 "line 4: no assistant turn with text", "rewards joined        3",
                 "telemetry ids unmatched 6", "trace-nobody"):
        assert line in out
