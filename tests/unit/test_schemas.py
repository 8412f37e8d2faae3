"""Every schema round-trips through the wire encoding; bad versions and shapes are refused clearly."""

from __future__ import annotations

import json

import pytest

from schemas import TOPICS, Trace, decode, topic
from schemas.dead_letter import DeadLetter
from services.common.errors import SchemaError, UnknownSchemaVersion
from tests.support.records import all_examples, trace


@pytest.mark.parametrize("msg", all_examples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(type(msg), msg.to_bytes()) == msg
    assert msg.to_bytes() == decode(type(msg), msg.to_bytes()).to_bytes()  # canonical


def test_dead_letter_round_trip_keeps_bytes():
    dl = DeadLetter(source_topic="traces", source_partition=0, source_offset=3, consumer="g",
                    reason="bad", error_type="SchemaError", original=b"\xff\x00not json")
    assert DeadLetter.model_validate_json(dl.model_dump_json()) == dl


def test_unknown_schema_version_is_refused_clearly():
    data = json.loads(trace().to_bytes())
    data["schema_version"] = 7
    with pytest.raises(UnknownSchemaVersion, match=r"schema_version 7 is not one this build reads \[1\]"):
        decode(Trace, json.dumps(data))
    del data["schema_version"]
    with pytest.raises(UnknownSchemaVersion, match="schema_version None"):
        decode(Trace, json.dumps(data))


@pytest.mark.parametrize("raw, match", [
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"schema_version": 1, "trace_id": "x"}', "received_at: Field required"),
])
def test_bad_payloads_raise_schema_error(raw, match):
    with pytest.raises(SchemaError, match=match):
        decode(Trace, raw)


def test_schema_error_is_also_a_value_error():
    with pytest.raises(ValueError):
        decode(Trace, b"nope")


def test_messages_are_frozen_and_strict():
    t = trace()
    with pytest.raises(Exception):
        t.query = "other"  # type: ignore[misc]
    data = json.loads(t.to_bytes())
    data["surprise"] = 1
    with pytest.raises(SchemaError, match="surprise"):
        decode(Trace, json.dumps(data))


def test_routed_trace_needs_router_version_and_distinct_providers():
    data = json.loads(trace().to_bytes())
    with pytest.raises(SchemaError, match="route"):
        decode(Trace, json.dumps({**data, "mode": "routed"}))
    route = {"router": "router@3", "ordering": ["a", "b"], "called": ["a"]}
    with pytest.raises(SchemaError, match="router_version"):
        decode(Trace, json.dumps({**data, "mode": "routed", "route": route}))
    assert decode(Trace, json.dumps({**data, "mode": "routed", "router_version": "router@3", "route": route})).route
    no_adapter = {"called": ["a"], "fallback": "no_adapter", "fallback_provider": "a"}
    assert decode(Trace, json.dumps({**data, "mode": "routed", "route": no_adapter})).router_version is None
    with pytest.raises(SchemaError, match="only a routed trace"):
        decode(Trace, json.dumps({**data, "route": route}))
    data["candidates"][1]["provider"] = data["candidates"][0]["provider"]
    with pytest.raises(SchemaError, match="distinct provider"):
        decode(Trace, json.dumps(data))


def test_topic_registry_keys_by_id():
    assert set(TOPICS) == {"traces", "verdicts", "episodes", "tasks", "adapters", "calibrations", "reviews", "calls",
                            "rollouts", "cycles"}
    assert topic("traces").key_of(trace("abc")) == b"abc"
    assert topic("traces").dlq == "traces.dlq"
    for spec in TOPICS.values():
        assert spec.partitions >= 1 and spec.key_field in spec.model.model_fields
    with pytest.raises(KeyError, match="unknown topic 'trace'"):
        topic("trace")
