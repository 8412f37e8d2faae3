"""The CLI and the gateway's entry point: bad input is a clear message and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main
from services.common.errors import ConfigError
from services.common.settings import KafkaSettings
from services.gateway.app import build_gateway, create_app
from services.gateway.settings import GatewaySettings
from services.providers.collections import (
    default_collections_dir,
    load_qrels,
    load_queries,
    sample_queries,
)
from services.providers.config import BM25Config
from services.providers.markets import load_providers_file
from services.tools.replay import replay
from tests.support.fakes import StaticProvider
from tests.support.serving import free_port, served

ROOT = Path(__file__).resolve().parents[2]


def test_replay_unknown_collection_is_a_clear_error(capsys):
    assert main(["replay", "--collections", "med,nope", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "cranfield" in err  # names the bad one and the known ones


def test_replay_bad_rate_is_a_clear_error(capsys):
    assert main(["replay", "--collections", "adi", "--limit", "1", "--rate", "0"]) == 2
    assert "rate must be > 0" in capsys.readouterr().err


def test_unknown_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_providers_file_errors_name_the_file_and_the_line(tmp_path):
    bad_toml = tmp_path / "p.toml"
    bad_toml.write_text('[[providers]]\ntype = "bm25"\nname = "x"\ncost_usd = = 1\n')
    with pytest.raises(ConfigError, match=r"p\.toml.*line 4"):
        load_providers_file(bad_toml)
    bad_type = tmp_path / "q.toml"
    bad_type.write_text('[[providers]]\ntype = "altavista"\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"q\.toml.*altavista"):
        load_providers_file(bad_type)
    ok = tmp_path / "ok.json"
    ok.write_text('{"providers": [{"type": "bm25", "name": "a", "collections": ["adi"]}]}')
    assert [p.name for p in load_providers_file(ok)] == ["a"]


def test_gateway_entry_point_refuses_bad_settings(tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text('[[providers]]\ntype = "bm25"\nname = "Has Spaces"\n')
    proc = subprocess.run([sys.executable, "-m", "services.gateway"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"FANROUTE_PROVIDERS_FILE": str(bad), "PATH": "/usr/bin"})
    assert proc.returncode == 2
    assert "invalid settings" in proc.stderr and "p.toml" in proc.stderr


def test_duplicate_provider_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        GatewaySettings(providers=[BM25Config(name="a"), BM25Config(name="a")])


def test_sample_queries_only_judged_and_deterministic():
    a = sample_queries(("cisi",), limit=500, seed=1)
    judged = load_qrels(default_collections_dir(), "cisi")
    assert len(a) == len(judged) < len(load_queries(default_collections_dir(), "cisi"))
    assert a == sample_queries(("cisi",), limit=500, seed=1) != sample_queries(("cisi",), limit=500, seed=2)
    assert all(q.query_id.startswith("cisi/") for q in a)


async def test_replay_against_a_running_gateway():
    port = free_port()
    settings = GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"), port=port,
                               providers=[BM25Config(name="unused")])
    gw = build_gateway(settings, providers=[StaticProvider("a", ("u1",)), StaticProvider("b", ("u2",))])
    async with served(create_app(settings, gateway=gw), port, what="gateway", start_timeout_s=30) as url:
        queries = sample_queries(("adi",), limit=6)
        summary = await replay(url, queries, rate=200, concurrency=3, progress=False)
    assert (summary.requests, summary.ok, summary.errors, summary.traces_spooled) == (6, 6, {}, 0)
    assert summary.contested == 6  # disjoint citations: overlap 0
    assert sorted(c for p in gw.providers for c in p.calls) == sorted(2 * [q.text for q in queries])


def test_dataset_as_of_garbage_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["dataset", "--out", "x.jsonl", "--as-of", "last tuesday"])
    assert info.value.code == 2 and "not an ISO-8601 time: 'last tuesday'" in capsys.readouterr().err


def test_tasks_verify_on_a_directory_that_is_not_a_task(tmp_path, capsys):
    assert main(["tasks", "verify", str(tmp_path), "--answer", "a > b"]) == 2
    assert "has no tests/test.sh" in capsys.readouterr().err


@pytest.mark.parametrize(("steps", "code"), [([{"step": 1, "skipped": "every group uniform, nothing to train on"}], 1),
                                             ([{"step": 1, "trained_version": 2}], 0)])
def test_rl_smoke_that_trained_nothing_says_why_and_exits_1(monkeypatch, tmp_path, capsys, steps, code):
    import services.tools.rl_recipes as recipes

    async def fake(name, tasks_dir, out_dir, **kw):  # the recipe's summary, without the stack
        return {"recipe": name, "steps": steps, "version": 2 if code == 0 else 1}

    monkeypatch.setattr(recipes, "main_async", fake)
    assert main(["rl", "smoke", "--tasks-dir", str(tmp_path)]) == code
    err = capsys.readouterr().err
    assert ("nothing was trained: every group was uniform" in err) == (code == 1)
