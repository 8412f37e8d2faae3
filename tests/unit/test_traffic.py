"""``fanroute traffic synth``: seeded pseudo-queries from the corpora, mixed as asked, never a dev query."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.common.errors import ConfigError
from services.providers.collections import default_collections_dir, load_qrels
from services.tools import traffic


@pytest.fixture(scope="module")
def synth():
    return traffic.synthesize(600, seed=3)


def test_never_the_text_of_a_dev_query(synth) -> None:
    """The guarantee, checked against every development query of every collection (judged or not)."""
    queries, report = synth
    forbidden, long_dev = traffic.dev_texts(default_collections_dir())
    assert len(forbidden) > 600  # the check has something to check against
    for q in queries:
        norm = traffic.normalise(q.text)
        assert norm not in forbidden and not any(d in norm for d in long_dev), q
        assert len(norm.split()) >= traffic.MIN_WORDS
    assert report.queries == len(queries) == 600 == len({traffic.normalise(q.text) for q in queries})


def test_ids_have_no_qrels_and_name_their_collection(synth) -> None:
    queries, report = synth
    d = default_collections_dir()
    for q in queries[:100]:
        collection, qid = q.query_id.split("/", 1)
        assert qid.startswith("synth-") and qid not in load_qrels(d, collection)
    assert set(report.by_kind) <= set(traffic.KINDS) and sum(report.by_kind.values()) == 600


def test_the_mix_is_the_stated_proportion_and_the_seed_decides(synth) -> None:
    queries, report = synth
    mix = traffic.default_mix(default_collections_dir())
    for name, share in mix.items():
        assert abs(report.by_collection.get(name, 0) - 600 * share) <= 1, name
    again, _ = traffic.synthesize(600, seed=3)
    assert again == queries
    other, _ = traffic.synthesize(600, seed=4)
    assert other != queries
    only, rep = traffic.synthesize(50, seed=0, mix={"adi": 1, "med": 3})
    assert rep.by_collection == {"adi": 12, "med": 38} or rep.by_collection == {"adi": 13, "med": 37}


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError, match="unknown collection"):
        traffic.synthesize(10, mix={"nope": 1.0})
    with pytest.raises(ConfigError, match="weights must be"):
        traffic.synthesize(10, mix={"adi": 0.0})
    with pytest.raises(ConfigError, match="only .* distinct pseudo-queries"):
        traffic.synthesize(5000, mix={"adi": 1.0})  # ADI has 82 documents
    with pytest.raises(ConfigError, match="is not <collection>=<weight>"):
        traffic.parse_mix("adi=lots")
    assert main(["traffic", "synth", "--n", "10", "--mix", "nope=1", "--out", str(tmp_path)]) == 2
    assert "unknown collection" in capsys.readouterr().err
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"query_id": "a", "text": "b"}\n{"text": "no id"}\n')
    with pytest.raises(ConfigError, match=r"q.jsonl:2: not a"):
        traffic.read_queries_file(bad)


def test_the_command_writes_what_replay_reads(tmp_path: Path, capsys) -> None:
    assert main(["traffic", "synth", "--n", "40", "--seed", "1", "--out", str(tmp_path)]) == 0
    back = traffic.read_queries_file(tmp_path / "queries.jsonl")
    report = json.loads((tmp_path / "synth.json").read_text())
    assert len(back) == 40 == report["queries"] and report["seed"] == 1
    assert "40 pseudo-queries" in capsys.readouterr().out
