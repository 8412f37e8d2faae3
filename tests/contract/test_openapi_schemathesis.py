"""The API contract: schemathesis, with all its checks, against every HTTP app served by uvicorn.

Each app (gateway, publisher, sampler, relay: :mod:`tests.support.contract`) is served on loopback with its
lifespan on, and ``st run <app>/openapi.json --checks all`` tests every operation in every phase
(examples, coverage, fuzzing, stateful), positive and negative data, bounded by ``MAX_EXAMPLES`` and a
fixed seed. A failed check is a broken contract: fix the app or its document, not this test. What no
JSON Schema can say is in ``hooks.py`` and ``schemathesis.toml`` beside this file.

Run alone: ``python -m pytest -q tests/contract``. By hand: ``python -m tests.support.contract`` serves
the apps, then ``SCHEMATHESIS_HOOKS=tests.contract.hooks st --config-file tests/contract/schemathesis.toml
run <url> --checks all``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.contract import APPS, StatusRecorder, ThreadServer, client_headers, seed

MAX_EXAMPLES = 20
#: Operations behind an existing version (or blob): the run must get a 2xx from each at least once, which
#: it did not while every generated id named nothing (404). ``hooks.py`` points positive cases at the seed.
DEEP = {"publisher": ("get_blob", "list_versions", "get_version", "get_file", "get_stamp", "promote", "promoted",
                      "serving", "report_serving")}
SEED = 20240613
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module", params=sorted(APPS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, str, dict[str, str], StatusRecorder]]:
    name = request.param
    app = APPS[name](tmp_path_factory.mktemp(name))
    with ThreadServer(app, name) as server:
        seed(app, server.url)
        yield name, server.url, client_headers(app), server.recorder


def test_every_app_keeps_its_openapi_contract(served: tuple[str, str, dict[str, str], StatusRecorder],
                                              tmp_path: Path) -> None:
    name, url, headers, recorder = served
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.contract.hooks", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "schemathesis.cli", "--no-color", "--config-file", str(HERE / "schemathesis.toml"),
           "run", f"{url}/openapi.json", "--checks", "all", "--mode", "all", "--max-examples", str(MAX_EXAMPLES),
           "--seed", str(SEED), "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
           "--report", "junit", "--report-dir", str(tmp_path)]
    for key, value in headers.items():  # credentials (the relay's episode and admin tokens)
        cmd += ["--header", f"{key}: {value}"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"schemathesis found {name}'s API off its OpenAPI document:\n{out[-20000:]}"
    assert "Tested:" in out and " passed" in out, out[-5000:]  # it ran operations, it did not skip them
    unreached = [op for op in DEEP.get(name, ()) if not recorder.reached(op)]
    assert not unreached, f"{name}: no generated request got a 2xx from {unreached}; answered: " \
                          f"{sorted(recorder.statuses.items())}"
