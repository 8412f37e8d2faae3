"""The AsyncAPI document: generated from the registry, committed as docs/asyncapi.json, kept current."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from schemas.topics import TOPICS
from services.common.asyncapi import DEFAULT_OUT, _slug, document, render_json
from services.common.settings import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_document_is_current():
    assert DEFAULT_OUT == ROOT / "docs" / "asyncapi.json"
    assert DEFAULT_OUT.is_file(), "docs/asyncapi.json is missing: run `fanroute asyncapi`"
    assert DEFAULT_OUT.read_text() == render_json(document()), \
        "docs/asyncapi.json is stale (the registry or a message model changed): run `fanroute asyncapi`"


def test_every_producer_and_consumer_is_an_operation_on_its_wire_topic():
    doc = document(KafkaSettings(topic_namespace="ns1."))
    assert doc["asyncapi"].startswith("3.") and doc["info"]["title"] == "fanroute topics"
    ops = {(doc["channels"][op["channel"]["$ref"].split("/")[-1]]["address"], op["action"], title)
           for title, op in doc["operations"].items()}
    want = set()
    for name, spec in TOPICS.items():
        want |= {(f"ns1.{name}", "send", f"{name}:{_slug(p)}:publish") for p in spec.producers}
        want |= {(f"ns1.{name}", "receive", f"{name}:{_slug(c)}:read") for c in spec.consumers}
    assert ops == want
    for title, channel in doc["channels"].items():
        spec = TOPICS[title.split(":")[0]]
        [ref] = [m["$ref"] for m in channel["messages"].values()]
        message = doc["components"]["messages"][ref.split("/")[-1]]
        assert message["payload"] == {"$ref": f"#/components/schemas/{spec.model.__name__}"}
        assert all(n in channel["description"] for n in (*spec.producers, *spec.consumers))
    for spec in TOPICS.values():  # the payload is the model's own JSON schema
        schema = doc["components"]["schemas"][spec.model.__name__]
        assert set(schema["properties"]) == set(spec.model.model_json_schema()["properties"])
        assert set(schema.get("required", ())) == set(spec.model.model_json_schema().get("required", ()))
    # a planned reader is named as such, never as an operation
    assert "call audit and replay tools (not yet built" in doc["channels"]["calls:relay:publish"]["description"]


def test_the_command_exits_0_and_writes_the_document(tmp_path):
    out, yml = tmp_path / "asyncapi.json", tmp_path / "asyncapi.yaml"
    run = subprocess.run([sys.executable, "-m", "services.cli", "asyncapi", "--out", str(out), "--yaml", str(yml)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == DEFAULT_OUT.read_text()
    import yaml

    assert yaml.safe_load(yml.read_text()) == json.loads(out.read_text())


def test_check_says_whether_a_file_is_current(tmp_path, capsys):
    from services.cli import main

    stale = tmp_path / "old.json"
    stale.write_text("{}\n")
    assert main(["asyncapi", "--out", str(stale), "--check"]) == 1
    assert stale.read_text() == "{}\n"  # --check writes nothing
    assert main(["asyncapi", "--out", str(DEFAULT_OUT), "--check"]) == 0
