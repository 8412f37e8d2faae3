"""The demo's loop on the real broker and redis-server: fan-out, judge, episodes, SFT, eval and promotion
decision, each record exactly once under content-derived ids — on a *fresh machine*: ``HOME`` and every
cache variable point at empty folders, no ``FANROUTE_BASE_MODEL``, the bundled collections.

Why the fresh machine: the demo once crashed for newcomers after training (the sampler's default model
path ignored ``$FANROUTE_MODELS_DIR``) while every test passed, because the tests' machines had a
prepared model in their home cache. Here the base model exists only where ``$FANROUTE_MODELS_DIR`` says
(the tiny model standing in for the prepared SmolLM2), so any default that looks elsewhere fails.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter

import pytest
import redis.asyncio as aioredis

from schemas import AdapterPublished, Episode, Task, Trace, Verdict, topic
from schemas.calibration import CalibrationRecord
from services.common import paths
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from services.common.stamps import parse_promoted, promoted_key
from services.episodes.build import build_episode
from services.episodes.tasks import build_task
from services.evaluate.promote import decide
from services.evaluate.report import read_report
from services.judge.settings import build_backend
from services.judge.settings_local import LocalJudgeConfig
from services.judge.worker import verdict_id
from services.providers.collections import sample_queries
from services.providers.markets import default_providers
from services.tools.demo import DemoOptions, demo_on
from services.tools.demo_loop import LoopOptions
from services.tools.demo_loop import MODEL_ID, held_out

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(240)]

QUERIES = 36  # judged development queries, drawn with the demo's seed: ~24 training episodes = 3 SFT steps of 8
HELD_OUT = 0.3


async def _records(kafka: KafkaSettings, name: str, model) -> list:
    """Every record now on topic ``name`` of this run's namespace (fresh: nothing else wrote there)."""
    return [m async for m in read_topic(kafka, topic(name), model=model, strict=True)]


async def test_the_demo_loop_on_the_real_stack(kafka_bootstrap, redis_url, tmp_path, monkeypatch, fresh_machine):
    ns = f"e2e{uuid.uuid4().hex[:8]}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns)
    monkeypatch.setenv("FANROUTE_JUDGE", '{"type": "local"}')  # the lexical local judge: no embedding model
    out = tmp_path / "demo"

    # The demo's own code path after its stack start-up (the session's broker and Redis stand in for it),
    # on a fresh topic namespace so every record read back below is this run's.
    code = await demo_on(DemoOptions(queries=QUERIES, out_dir=out, held_out_fraction=HELD_OUT), kafka, redis_url)
    assert code == 0

    # the fresh machine: indexes built where $FANROUTE_CACHE_DIR says, nothing of ours under HOME
    assert any((fresh_machine[paths.CACHE_DIR_ENV] / "indexes").iterdir())
    assert not (fresh_machine["HOME"] / ".cache" / "fanroute").exists()

    queries = {q.query_id for q in sample_queries(limit=QUERIES, seed=0)}
    held = {q for q in queries if held_out(q, HELD_OUT)}
    assert len(queries) == QUERIES and 0 < len(held) < QUERIES
    names = {p.name for p in default_providers()}

    # traces: one fan-out trace per query, then one more per held-out query from the routed phase
    traces = await _records(kafka, "traces", Trace)
    assert len({t.trace_id for t in traces}) == len(traces)
    assert Counter(t.query_id for t in traces) == {q: 1 + (q in held) for q in queries}
    traces.sort(key=lambda t: t.received_at)  # the routed phase starts after training, after every fan-out one
    fanout_era, routed_era = traces[:QUERIES], traces[QUERIES:]
    assert {t.query_id for t in fanout_era} == queries and {t.query_id for t in routed_era} == held
    assert all(t.mode == "fanout" and {c.provider for c in t.candidates} == names for t in fanout_era)
    by_id = {t.trace_id: t for t in fanout_era}

    # verdicts: exactly one per fan-out trace (the demo judges every one), id derived from (trace, judge, rubric)
    backend = build_backend(LocalJudgeConfig())
    verdicts = await _records(kafka, "verdicts", Verdict)
    assert sorted(v.trace_id for v in verdicts) == sorted(by_id)
    assert sorted(v.verdict_id for v in verdicts) == sorted(verdict_id(t, backend, backend.rubric) for t in by_id)
    assert all(v.status == "ok" and v.ordering for v in verdicts)
    by_trace = {v.trace_id: v for v in verdicts}

    # episodes and replay tasks: the join of each trace with its verdict, once each, equal to a rebuild from content
    episodes = await _records(kafka, "episodes", Episode)
    assert sorted(ep.trace_id for ep in episodes) == sorted(by_id)
    for ep in episodes:
        assert ep == build_episode(by_id[ep.trace_id], by_trace[ep.trace_id], now=ep.created_at)
        assert {c.source for c in ep.rewards} == {by_trace[ep.trace_id].verdict_id}
    tasks = await _records(kafka, "tasks", Task)
    assert tasks and len({t.trace_id for t in tasks}) == len(tasks) and {t.trace_id for t in tasks} <= set(by_id)
    for task in tasks:
        assert task.task_id == build_task(by_id[task.trace_id], by_trace[task.trace_id]).task_id
    dataset = [json.loads(line) for line in (out / "episodes" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(d["episode_id"] for d in dataset) == sorted(ep.episode_id for ep in episodes)

    # the calibration gate on the topic, and the trainer's own reading of it
    [gate] = await _records(kafka, "calibrations", CalibrationRecord)
    assert gate.human_source == "qrels" and set(gate.providers) == names
    run_dir = out / "train" / "run"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["allow_uncalibrated"] is (not gate.open)
    assert [g["status"] for g in config["gates"]] == ["open" if gate.open else "unchecked"]

    # a few SFT steps on the tiny model, published once as router@1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m and "event" not in m]
    assert len(steps) >= 2 and all(math.isfinite(m["loss"]) for m in steps)
    assert [m["steps"] for m in metrics if m.get("event") == "end"] == [len(steps)]
    adapters = await _records(kafka, "adapters", AdapterPublished)
    assert [(a.model_id, a.version, a.base_model) for a in adapters if not a.promoted] == [(MODEL_ID, 1, paths.DEFAULT_BASE)]

    # evaluation on the held-out queries and the promotion rule's decision: the scoring router decides every
    # query (no fallbacks) and is drawn over λ on the cost-quality plane; the tiny random router cannot beat
    # the best single provider, so it is refused
    report = read_report(out / "eval" / "eval.json")
    assert report.inputs.candidate == f"{MODEL_ID}@1" and report.inputs.held_out == len(held)
    assert report.policies["candidate"].fallbacks == {} and report.policies["candidate"].router_p99_ms > 0
    assert set(report.frontier) == {"human", "judge"} and (out / "eval" / "frontier.png").is_file()
    decision = json.loads((out / "eval" / "decision.json").read_text())
    rule = decide(report, max_router_p99_ms=LoopOptions().max_router_p99_ms)
    assert (decision["decision"], decision["reasons"]) == (rule.decision, rule.reasons)
    assert decision["decision"] == "refuse" and decision["reasons"] and decision["promoted"] is False
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert parse_promoted(await r.get(promoted_key(ns, MODEL_ID))) is None
    finally:
        await r.aclose()
    assert not any(a.promoted for a in adapters)

    # routed phase: nothing promoted, so outside the fan-out slice the best single provider answers
    best = report.inputs.best_single.provider
    routed = [t for t in routed_era if t.mode == "routed"]
    assert routed and all(t.route.fallback == "no_adapter" and t.route.fallback_provider == best for t in routed)
