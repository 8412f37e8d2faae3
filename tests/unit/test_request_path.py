"""The request path's fast parts keep their contracts: the wire encoding decodes to what the canonical
one does, the provider decoder accepts what the standard one accepts, the loop is the one asked for."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from schemas.base import canonical_json, fast_loads, wire_json
from tests.support.records import trace


def test_the_wire_encoding_is_the_canonical_one_for_a_trace() -> None:
    t = trace(trace_id="wire-1")
    assert wire_json(t.model_dump(mode="json")) == canonical_json(t.model_dump(mode="json")) == t.to_bytes()


@pytest.mark.parametrize("value", [{"b": 1e-05, "a": "é ü 中"}, {"n": 2**70, "z": [1, 2.5]}, {"x": 1e16}])
def test_the_wire_encoding_decodes_to_the_same_values_with_sorted_keys(value) -> None:
    raw = wire_json(value)
    assert json.loads(raw) == value
    assert list(json.loads(raw)) == sorted(value)
    assert b" " not in raw.replace("é ü 中".encode(), b"")


def test_fast_loads_reads_what_the_standard_decoder_reads_and_refuses_the_rest() -> None:
    assert fast_loads(b'{"a": [1, 2], "b": "x"}') == {"a": [1, 2], "b": "x"}
    assert math.isnan(fast_loads(b'{"s": NaN}')["s"])  # orjson refuses it; the fallback keeps it readable
    for bad in (b"", b"{", b"nope", b'{"a": }'):
        with pytest.raises(ValueError):
            fast_loads(bad)


@pytest.mark.parametrize("choice", ["asyncio", "uvloop", "auto"])
def test_a_service_runs_on_the_event_loop_it_is_configured_for(choice, monkeypatch) -> None:
    uvloop = pytest.importorskip("uvloop") if choice != "asyncio" else None
    from services.common.entry import service_main
    from services.common.settings import ServiceSettings

    monkeypatch.setenv("FANROUTE_EVENT_LOOP", choice)
    seen: list[type] = []

    async def run(settings: ServiceSettings) -> None:
        seen.append(type(asyncio.get_running_loop()))

    assert service_main("probe", ServiceSettings, run, argv=[]) == 0
    if uvloop is not None:
        assert issubclass(seen[0], uvloop.Loop), seen
    else:
        assert issubclass(seen[0], asyncio.BaseEventLoop) and seen[0].__module__.startswith("asyncio"), seen


def test_an_unknown_event_loop_is_refused_naming_the_setting(monkeypatch, capsys) -> None:
    from services.common.entry import service_main
    from services.common.settings import ServiceSettings

    monkeypatch.setenv("FANROUTE_EVENT_LOOP", "trio")

    async def run(settings: ServiceSettings) -> None:
        raise AssertionError("must not run")

    assert service_main("probe", ServiceSettings, run, argv=[]) == 2
    assert "event_loop" in capsys.readouterr().err


def test_a_service_runs_with_the_collector_thresholds_it_is_configured_for(monkeypatch) -> None:
    import gc

    from services.common.entry import service_main
    from services.common.settings import ServiceSettings

    before = gc.get_threshold()
    seen: list[tuple[int, ...]] = []

    async def run(settings: ServiceSettings) -> None:
        seen.append(gc.get_threshold())

    assert service_main("probe", ServiceSettings, run, argv=[]) == 0
    monkeypatch.setenv("FANROUTE_GC__YOUNG", "5000")
    monkeypatch.setenv("FANROUTE_GC__OLD", "7")
    assert service_main("probe", ServiceSettings, run, argv=[]) == 0
    assert seen == [(20_000, 20, 20), (5000, 20, 7)]
    assert gc.get_threshold() == before  # given back to the process that called it


@pytest.mark.parametrize("var,value", [("FANROUTE_GC__YOUNG", "10"), ("FANROUTE_GC__OLD", "lots"),
                                       ("FANROUTE_GC__FREEZE", "maybe")])
def test_a_bad_collector_setting_is_refused_naming_it(var, value, monkeypatch, capsys) -> None:
    from services.common.entry import service_main
    from services.common.settings import ServiceSettings

    monkeypatch.setenv(var, value)

    async def run(settings: ServiceSettings) -> None:
        raise AssertionError("must not run")

    assert service_main("probe", ServiceSettings, run, argv=[]) == 2
    assert f"gc.{var.removeprefix('FANROUTE_GC__').lower()}" in capsys.readouterr().err


def test_what_exists_once_an_app_is_built_is_frozen_out_of_the_collectors_reach() -> None:
    import gc

    from services.common.entry import freeze_setup
    from services.common.settings import GcSettings

    gc.unfreeze()
    try:
        freeze_setup(GcSettings(freeze=False))
        assert gc.get_freeze_count() == 0
        freeze_setup(GcSettings())
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_one_unusable_hit_is_skipped_and_the_rest_ranked_in_one_pass() -> None:
    from services.providers.web_base import Hit, rank

    hits = [Hit(url=f"https://e.org/{i}", title=f"t{i}", snippet="s") for i in range(4)]
    hits.insert(1, Hit(url="https://e.org/" + "x" * 5000, title="too long", snippet="s"))
    hits.insert(2, Hit(url="", title="no url", snippet="s"))
    got = rank(hits, 3)
    assert [(c.url, c.rank) for c in got] == [("https://e.org/0", 1), ("https://e.org/1", 2), ("https://e.org/2", 3)]
    assert [c.rank for c in rank(hits[:1] + hits[3:], 10)] == [1, 2, 3, 4]


def test_an_unknown_compression_or_an_oversized_batch_is_refused_naming_the_field() -> None:
    from pydantic import ValidationError

    from services.common.settings import KafkaSettings

    with pytest.raises(ValidationError, match="compression"):
        KafkaSettings(compression="brotli")
    with pytest.raises(ValidationError, match="max_batch_bytes"):
        KafkaSettings(max_batch_bytes=2_000_000)
