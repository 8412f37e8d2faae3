"""bench/routed_fixture.local_stack_left_as_found: a benchmark that started the local stack stops it,
one that found it running (or was told --keep-stack) leaves it."""

from __future__ import annotations

import pytest

import devstack
from bench.routed_fixture import local_stack_left_as_found


@pytest.fixture
def stack(monkeypatch):
    state = {"running": set(), "downs": 0}

    def status(*_a, **_k):
        return {c: {"running": c in state["running"]} for c in devstack.COMPONENTS}

    def down(*_a, **_k):
        state["running"].clear()
        state["downs"] += 1

    monkeypatch.setattr(devstack, "status", status)
    monkeypatch.setattr(devstack, "down", down)
    return state


def test_a_stack_the_run_started_is_stopped(stack):
    with local_stack_left_as_found():
        stack["running"].add("kafka")
    assert stack["downs"] == 1 and not stack["running"]


def test_a_stack_found_running_is_left(stack):
    stack["running"].add("redis")
    with local_stack_left_as_found():
        stack["running"].add("kafka")
    assert stack["downs"] == 0 and stack["running"] == {"redis", "kafka"}


def test_keep_stack_leaves_it_and_a_failed_run_still_stops_it(stack):
    with local_stack_left_as_found(keep=True):
        stack["running"].add("kafka")
    assert stack["downs"] == 0
    stack["running"].clear()
    with pytest.raises(RuntimeError), local_stack_left_as_found():
        stack["running"].add("kafka")
        raise RuntimeError("the benchmark failed")
    assert stack["downs"] == 1
