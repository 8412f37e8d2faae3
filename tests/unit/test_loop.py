"""The loop's pure parts: slots, drift, the degradation scenario, the history, and its command line."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from schemas.cycle import CycleRecord, cycle_id, record_id
from services.common.errors import ConfigError
from services.loop.cli import duration, main
from services.loop.drift import drift_of
from services.loop.history import Cycle, History
from services.loop.settings import LoopSettings
from services.loop.worker import current_slot, next_slot, render
from services.providers.base import Provider, ProviderAnswer
from services.providers.drift import DriftingProvider, DriftSpec, parse_drift, with_drift
from tests.support.records import citation

NOW = datetime(2026, 12, 5, 10, 17, 30, tzinfo=UTC)


def test_slots_align_to_the_interval_or_the_time_of_day() -> None:
    hourly = LoopSettings(every_s=3600)
    assert current_slot(hourly, NOW) == datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
    assert next_slot(hourly, NOW) == datetime(2026, 12, 5, 11, 0, tzinfo=UTC)
    nightly = LoopSettings(at="02:00")
    assert current_slot(nightly, NOW) == datetime(2026, 12, 5, 2, 0, tzinfo=UTC)
    assert next_slot(nightly, NOW) == datetime(2026, 12, 6, 2, 0, tzinfo=UTC)
    late = LoopSettings(at="23:30")
    assert current_slot(late, NOW) == datetime(2026, 12, 4, 23, 30, tzinfo=UTC)  # today's is still to come


def test_drift_is_the_largest_grade_change_over_providers_with_enough_verdicts() -> None:
    reference = {"a": [3.0] * 30, "b": [2.0] * 30, "c": [1.0] * 5}
    recent = {"a": [1.0] * 30, "b": [2.0] * 30, "c": [3.0] * 5}  # c moved most, but on too few verdicts
    d = drift_of(reference, recent, threshold=0.1, min_n=20)
    assert d.worst == "a" and d.score == pytest.approx(2 / 3) and d.triggered
    by = {p.provider: p for p in d.providers}
    assert by["a"].delta == pytest.approx(-2.0) and by["b"].delta == 0 and by["c"].delta is None
    calm = drift_of(reference, reference, threshold=0.1, min_n=20)
    assert calm.score == 0 and not calm.triggered
    assert drift_of({}, {}, threshold=0.1, min_n=1).score is None


def test_the_drift_scenario_parses_and_refuses_what_it_cannot_do() -> None:
    (spec,) = parse_drift("biomed:0.2@2026-12-05T10:00:00")
    assert spec == DriftSpec("biomed", 0.2, datetime(2026, 12, 5, 10, 0, tzinfo=UTC))
    assert parse_drift("a:1, b:0") == (DriftSpec("a", 1.0), DriftSpec("b", 0.0))
    assert parse_drift(None) == () and parse_drift("") == ()
    for bad, why in (("biomed", "is not <provider>"), ("biomed:1.5", "within 0..1"), ("biomed:0.2@noon", "ISO 8601"),
                     ("a:0.1,a:0.2", "named twice")):
        with pytest.raises(ConfigError, match=why):
            parse_drift(bad)
    with pytest.raises(ConfigError, match="no provider named 'zz'"):
        with_drift([], parse_drift("zz:0.5"))


class _Corpus(Provider):
    """A provider with a local corpus: answers its first document; noise comes from the rest."""

    def __init__(self) -> None:
        super().__init__("vert", cost_usd=0.001, timeout_s=1.0, k=3)
        from services.providers.collections import Doc

        self._docs = tuple(Doc("adi", str(i), f"title {i}", f"text {i}") for i in range(50))

    @staticmethod
    def _citation(rank, doc, score):
        return citation(f"collection://{doc.collection}/{doc.doc_id}", rank, title=doc.title, snippet=doc.text)

    async def search(self, query: str) -> ProviderAnswer:
        return ProviderAnswer(citations=(citation("collection://adi/0", 1),), answer="real", cost_usd=self.cost_usd)


def test_a_degraded_provider_answers_noise_for_the_share_it_does_not_keep() -> None:
    inner = _Corpus()
    before = DriftingProvider(inner, DriftSpec("vert", 0.2, NOW + timedelta(days=1)))
    after = DriftingProvider(inner, DriftSpec("vert", 0.2, NOW - timedelta(days=1)))
    queries = [f"query {i}" for i in range(400)]
    assert not any(before.degraded(q, NOW) for q in queries)  # at a fixed time: not a test that expires
    noisy = [q for q in queries if after.degraded(q, NOW)]
    assert 0.7 < len(noisy) / len(queries) < 0.9  # keeps 20 %
    assert noisy == [q for q in queries if after.degraded(q)]  # the same queries every time

    async def both(q: str):
        await after.start()
        return await after.search(q), await after.search(q)

    a, b = asyncio.run(both(noisy[0]))
    assert a == b and a.raw_meta["drift"] == "noise" and len(a.citations) == 3
    assert a.answer != "real" and {c.url for c in a.citations} != {"collection://adi/0"}
    kept = next(q for q in queries if not after.degraded(q))
    assert asyncio.run(after.search(kept)).answer == "real"


def _record(cid: str, slot: datetime, phase: str, at: datetime, **kw) -> CycleRecord:
    return CycleRecord(record_id=record_id(cid, phase), cycle_id=cid, phase=phase, at=at, model_id="router",
                       kind="linear", slot=slot, trigger="once", code_version="t", **kw)


def test_the_history_finds_the_unfinished_the_last_trained_and_the_deployed_cycle() -> None:
    s1, s2, s3 = (NOW + timedelta(hours=h) for h in (0, 1, 2))
    c1, c2, c3 = (Cycle(cycle_id("router", "linear", s), s) for s in (s1, s2, s3))
    for phase in ("started", "trained", "evaluated", "promoted", "finished"):
        c1.phases[phase] = _record(c1.cycle_id, s1, phase, s1)
    for phase in ("started", "skipped"):
        c2.phases[phase] = _record(c2.cycle_id, s2, phase, s2)
    for phase in ("started", "trained"):
        c3.phases[phase] = _record(c3.cycle_id, s3, phase, s3, adapter_out="router@2")
    h = History([c1, c2, c3])
    assert h.unfinished() is c3 and h.last_ran() is c3 and h.deployed() is c1
    assert c1.ended and c2.ended and not c3.ended and c1.last.phase == "finished" and c2.last.phase == "skipped"
    assert cycle_id("router", "linear", s1) != cycle_id("router", "lm", s1)
    assert "skipped" in render(_record(c2.cycle_id, s2, "skipped", s2, reason="3 new episodes"))


@pytest.mark.parametrize(("argv", "field"), [
    (["--at", "25:00"], "at"), (["--every", "0s"], "every_s"), (["--min-new-episodes", "-1"], "min_new_episodes"),
    (["--held-out-fraction", "1.5"], "held_out_fraction"), (["--publisher-url", "ftp://x"], "publisher_url"),
    (["--slot", "2026-12-05T02:00:00Z"], "slot"), (["--router-mode", "psychic"], "router_mode"),
])
def test_bad_settings_exit_2_naming_the_field(argv, field, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fanroute loop: invalid settings: ") and field in err, err


@pytest.mark.parametrize("argv", [["--every", "2x"], ["--kind", "tree"], ["--once", "--at", "02:00"], ["--bogus"]])
def test_bad_flags_exit_2_naming_the_flag(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_help_and_show_settings_touch_nothing(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "FANROUTE_DRIFT_THRESHOLD" in capsys.readouterr().out
    assert main(["--once", "--kind", "linear", "--every", "15m", "--show-settings"]) == 0
    out = capsys.readouterr().out
    assert '"every_s": 900.0' in out and '"kind": "linear"' in out and '"once": true' in out
    assert list(tmp_path.iterdir()) == []
    assert duration("24h") == 86_400 and duration("90") == 90 and duration("1.5m") == 90


@pytest.mark.parametrize(("argv", "flag"), [(["--windows", "1"], "--windows"), (["--keep", "2"], "--keep"),
                                            (["--degrade-from", "5"], "--degrade-from"), (["--rate", "0"], "--rate"),
                                            (["--queries", "5"], "--queries")])
def test_the_loop_demo_refuses_bad_flags_naming_them(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_the_loop_demo_refuses_a_provider_not_in_the_market(capsys) -> None:
    assert main(["demo", "--degrade", "nosuch"]) == 2
    assert "--degrade: no provider 'nosuch'" in capsys.readouterr().err
