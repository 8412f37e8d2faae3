"""``fanroute loop demo`` on the real broker and redis-server, on a fresh machine (``HOME`` and every cache
variable at empty folders): two short windows, the second with ``web-lexical`` degraded; every cycle ends,
its records are on the ``cycles`` topic, the second cycle's start records the slice's drift, and the
table's JSON and plot are written."""

from __future__ import annotations

import json
import uuid

import pytest

from schemas import topic
from schemas.cycle import CycleRecord
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.loop.demo import LoopDemoOptions, demo_on

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


async def test_the_loop_demo_runs_two_windows_and_measures_the_drift(kafka_bootstrap, redis_url, tmp_path,
                                                                     monkeypatch, fresh_machine):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"ld{uuid.uuid4().hex[:8]}.")
    monkeypatch.setenv("FANROUTE_JUDGE", '{"type": "local"}')  # the lexical local judge: no embedding model
    opts = LoopDemoOptions(windows=2, queries=60, rate=20.0, out_dir=tmp_path / "loop-demo", min_new_episodes=10)
    assert await demo_on(opts, kafka, redis_url) == 0

    records = [r async for r in read_topic(kafka, topic("cycles"), model=CycleRecord, strict=True)]
    cycles: dict[str, list[str]] = {}
    for r in records:
        cycles.setdefault(r.cycle_id, []).append(r.phase)
    assert len(cycles) == 2 and all(p[0] == "started" and p[-1] in ("finished", "failed") for p in cycles.values())
    second = [r for r in records if r.phase == "started"][1]
    assert second.drift is not None and second.drift.score is not None  # the slice before and after window 2
    rows = json.loads((opts.out_dir / "loop-demo.json").read_text())["rows"]
    assert [(r["window"], r["degraded"]) for r in rows] == [(1, False), (2, True)]
    assert rows[1]["drift"] == second.drift.score and (opts.out_dir / "loop-demo.png").is_file()
