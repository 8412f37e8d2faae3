"""The demo's second half: distill the judged traces into a student, evaluate it, promote it only if
it wins, and send held-out traffic through the gateway in routed mode.

Every service runs for real in this process (publisher, CPU sampler, gateway on uvicorn; Kafka and
Redis from the local stack); only the orchestration is demo-specific.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

from schemas.episode import Episode
from schemas.trace import Trace
from services.common.dataset import write_jsonl
from services.common.settings import KafkaSettings, RedisSettings
from services.router.modes import Decision, RouterMode
from services.router.policy import held_out
from services.tools.serving import free_port, served
from services.tools.steps import step

MODEL_ID = "router"


@dataclass(frozen=True)
class LoopOptions:
    """Knobs of the distill → evaluate → promote → route half."""

    held_out_fraction: float = 0.3
    allow_uncalibrated: bool = False  # only when the judge's gate is closed; the run records it
    max_steps: int = 1000  # one pass over the training split caps it
    passes: int = 1  # at most this many chained one-pass runs, each from the previous adapter (--init-adapter)
    # which pass is published: "route" — the best by the gateway's objective on the trainer's own eval episodes
    # (share routed into the judge's top tier − λ · cost: pass_utility), stopping early once a pass from
    # min_passes on scores more than one eval episode below the best before it; "last" — every pass runs and
    # the last is published
    select_pass: Literal["route", "last"] = "route"
    min_passes: int = 2  # a second pass added +0.04 in every recipe (bench/sft_recipes.py): never stop before it
    batch_size: int = 8
    router_max_tokens: int = 8  # the top of the ordering is what routing needs; ~0.1 s per token on CPU
    router_timeout_s: float = 5.0
    # first-token: one forward decides (the same decision as the K-prompt score mode on 372/372 held-out
    # decisions, 1.4x faster at 1 concurrent and 1.7x at 20; bench/results/router_decision_lean_fp32.json);
    # the evaluation and the routed gateway ask the same way
    router_mode: RouterMode = "first-token"
    # λ (quality per USD) and the decision of the evaluation's router rows and of the routed gateway: the top-tier
    # decision at λ = 150 was chosen by 5-fold cross-validation on a demo's training split only (judge 2.196 vs
    # web-lexical's 2.173 at 55 % of its cost there; on a second demo's split 2.154 vs 2.179 at 53 %:
    # bench/decision_rules.py, docs/benchmarks.md#decision-rules); the held-out queries never chose it
    cost_weight: float = 150.0
    decision: Decision = "top-tier"
    max_router_p99_ms: float = 2000.0  # the promotion's latency rule: the router's own p99 on the held-out queries
    fanout_fraction: float = 0.1
    # The CPU sampler answers about one routing request per second (generation is serialised), so the
    # routed phase sends a bounded number of held-out queries at a rate it can keep up with.
    routed_queries: int = 60
    rate: float = 1.5
    concurrency: int = 4


@dataclass(frozen=True)
class Split:
    """Training episodes and the held-out fan-out traces (queries the student never sees)."""

    train_file: Path
    traces_file: Path
    n_train: int
    held_out: list[Trace]


def split(traces: list[Trace], episodes: list[Episode], fraction: float, out_dir: Path) -> Split:
    """Write the training episodes and the traces the evaluation reads as JSONL under ``out_dir``.

    The traces file holds the held-out traces *and* the training episodes' own traces: the evaluation
    drops every trained query itself, and reads the training traces' query ids for the per-domain best.
    """
    from services.tools.traffic import is_synthetic

    # only development queries (with human qrels) are ever held out; synthetic traffic only trains
    held = {t.trace_id for t in traces if not is_synthetic(t.query_id) and held_out(t.query_id or t.query, fraction)}
    train = [ep for ep in episodes if ep.trace_id not in held]
    train_file = write_jsonl(train, out_dir / "train" / "episodes.jsonl")
    traces_file = out_dir / "eval" / "traces.jsonl"
    traces_file.parent.mkdir(parents=True, exist_ok=True)
    trained = {ep.trace_id for ep in train}
    held_traces = [t for t in traces if t.trace_id in held]
    eval_traces = [t for t in traces if t.trace_id in held or t.trace_id in trained]
    traces_file.write_text("".join(t.model_dump_json() + "\n" for t in eval_traces))
    return Split(train_file, traces_file, len(train), held_traces)


async def distill_and_route(kafka: KafkaSettings, redis_url: str, data: Split, gateway_settings, out_dir: Path,
                            opts: LoopOptions, first: int, steps: int) -> int:
    """Train → publish → (sampler) → eval → promote-if-better → routed traffic; returns an exit code."""
    from services.publisher.app import create_app as publisher_app
    from services.publisher.settings import PublisherSettings
    from services.sampler.app import create_app as sampler_app
    from services.sampler.settings import SamplerSettings

    redis = RedisSettings(url=redis_url)
    store = out_dir / "publisher"
    shutil.rmtree(store, ignore_errors=True)  # a fresh stack has fresh topics and stamps: start clean
    pport, sport = free_port(), free_port()
    pub = PublisherSettings(kafka=kafka, redis=redis, port=pport, storage_dir=store,
                            public_url=f"http://127.0.0.1:{pport}")
    async with served(publisher_app(pub), pport, what="publisher") as publisher_url:
        passes = "one pass" if opts.passes == 1 else (
            f"up to {opts.passes} chained one-pass runs, the best by routing on its eval episodes published"
            if opts.select_pass == "route" else f"{opts.passes} chained one-pass runs")
        step(first, steps, f"training the student: LoRA SFT of SmolLM2-135M-Instruct on {data.n_train} "
                           f"episodes (CPU, {passes}, target: the judge's cost-aware first choice), then "
                           f"publishing it to {publisher_url}")
        costs = ",".join(f"{p.name}={p.cost_usd:g}" for p in gateway_settings.providers)
        result = await asyncio.to_thread(_train, kafka, redis, data.train_file, publisher_url, out_dir, opts, costs)
        candidate = f"{MODEL_ID}@{result['published']['version']}"
        samp = SamplerSettings(kafka=kafka, redis=redis, port=sport, publisher_url=publisher_url,
                               adapter_cache_dir=out_dir / "sampler-cache", group_id=f"demo-sampler-{sport}")
        async with served(sampler_app(samp), sport, what="sampler") as sampler_url:
            step(first + 1, steps, f"evaluating {candidate} (served by the CPU sampler at {sampler_url}) on the "
                                   f"{len(data.held_out)} held-out-split traces, less any whose query is also a "
                                   "training query, against the deployed router, the linear router, the best "
                                   "single provider, the oracle and fan-out")
            report, decision = await _evaluate_and_promote(kafka, data, candidate, publisher_url, sampler_url,
                                                           gateway_settings.providers, out_dir, opts)
            step(first + 2, steps, "routed traffic: the gateway in routed mode over the held-out queries")
            if not decision.promoted:
                print(f"      {candidate} was not promoted and nothing was before it: outside the fan-out slice the "
                      f"best single provider ({report.inputs.best_single.provider}) answers, counted as "
                      "no_adapter fallbacks", flush=True)
            code = await _routed_traffic(kafka, redis, gateway_settings, sampler_url, publisher_url, report, data,
                                         opts)
    print(f"\nresult: {candidate} {'PROMOTED' if decision.promoted else 'not promoted'}; the evaluation table:")
    from services.evaluate.report import render

    print(render(report))
    return code


def pass_utility(final: Mapping[str, Any], cost_weight: float) -> float | None:
    """The gateway's objective measured on a pass's own eval episodes: the share of picks in the judge's top
    tier (``test/route_best``) − λ · their mean cost (``test/route_cost``); None when the pass measured none."""
    best = final.get("test/route_best")
    if not isinstance(best, (int, float)):
        return None
    return float(best) - cost_weight * float(final.get("test/route_cost") or 0.0)


def stop_after(utilities: Sequence[float | None], min_passes: int, margin: float = 0.0) -> bool:
    """Whether to stop after the latest pass: it is at least the ``min_passes``-th and scored more than
    ``margin`` below the best pass before it (patience 1; an unmeasured pass never stops the chain)."""
    earlier = [u for u in utilities[:-1] if u is not None]
    return (len(utilities) >= max(min_passes, 2) and utilities[-1] is not None and bool(earlier)
            and utilities[-1] < max(earlier) - margin)


def one_query(final: Mapping[str, Any]) -> float:
    """What one eval episode moves a pass's top-tier share by (1 / ``test/route_n``): a pass worse by less is
    within the noise of its few eval episodes and does not stop the chain."""
    n = final.get("test/route_n")
    return 1.0 / float(n) if isinstance(n, (int, float)) and n > 0 else 0.0


def chosen_pass(utilities: Sequence[float | None]) -> int:
    """Index of the pass to publish: the best utility, a tie going to the later (more trained) pass; the last
    when none was measured."""
    scored = [(u, i) for i, u in enumerate(utilities) if u is not None]
    return max(scored)[1] if scored else len(utilities) - 1


def _train(kafka: KafkaSettings, redis: RedisSettings, train_file: Path, publisher_url: str, out_dir: Path,
           opts: LoopOptions, costs: str = ""):
    """Up to ``opts.passes`` chained one-pass SFT runs (progress lines from the trainer), each starting from the
    previous adapter with its own data order; then the chosen pass (``opts.select_pass``) is copied to
    ``train/run`` and published. Each run is ``python -m services.trainer`` in its own process, so what it
    held is given back before the sampler loads. The trainer checks the judge's calibration gate on Kafka
    itself; only a closed gate makes the demo pass ``allow_uncalibrated`` (recorded by the run). Returns the
    chosen run's summary with what the publisher answered."""
    from services.common.publisher_client import PublisherClient
    from services.trainer import launch
    from services.trainer.settings import TrainerSettings

    if opts.allow_uncalibrated:
        print("      the judge's calibration gate is CLOSED: training with allow_uncalibrated (recorded)", flush=True)
    results: list[dict[str, Any]] = []
    utilities: list[float | None] = []
    init, settings = None, None
    for k in range(opts.passes):
        if opts.passes > 1:
            print(f"      pass {k + 1} of at most {opts.passes}" + (f", starting from {init}" if init else ""), flush=True)
        settings = TrainerSettings(kafka=kafka, redis=redis, episodes_file=train_file,
                                   allow_uncalibrated=opts.allow_uncalibrated, seed=k, init_adapter=init,
                                   output_dir=out_dir / "train" / f"run-pass{k + 1}",
                                   max_steps=opts.max_steps, batch_size=opts.batch_size, eval_fraction=0.1,
                                   eval_every=0, eval_max_examples=40, checkpoint_every=0, publisher_url=None,
                                   model_id=MODEL_ID, route_cost_weight=opts.cost_weight, route_costs=costs)
        shutil.rmtree(settings.output_dir, ignore_errors=True)
        results.append(launch.train_in_process(settings))  # its own process: its memory is given back when it ends
        init = Path(results[-1]["adapter_dir"])
        utilities.append(pass_utility(results[-1].get("final") or {}, opts.cost_weight))
        if utilities[-1] is not None:
            print(f"      pass {k + 1}: top tier − λ·cost on the trainer's eval episodes = {utilities[-1]:.3f}", flush=True)
        if opts.select_pass == "route" and stop_after(utilities, opts.min_passes, one_query(results[-1].get("final") or {})):
            print(f"      stopping early: pass {k + 1} scored more than one eval episode below pass "
                  f"{chosen_pass(utilities) + 1}", flush=True)
            break
    assert settings is not None, "passes must be at least 1"
    pick = chosen_pass(utilities) if opts.select_pass == "route" else len(results) - 1
    run = out_dir / "train" / "run"  # where the demo's adapter is looked for (benches, the console)
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(out_dir / "train" / f"run-pass{pick + 1}", run)
    chosen = {**results[pick], "adapter_dir": str(run / "adapter"), "pass": pick + 1, "passes_run": len(results)}
    print(f"      publishing pass {pick + 1} of {len(results)} run" + (" (chosen by routing on the trainer's eval "
          "episodes)" if opts.select_pass == "route" else ""), flush=True)
    metrics = {k: float(v) for k, v in (chosen.get("final") or {}).items() if isinstance(v, (int, float))}
    with PublisherClient(publisher_url) as client:
        chosen["published"] = client.publish(MODEL_ID, run / "adapter", settings.base_model, metrics)
    (run / "summary.json").write_text(json.dumps(chosen, indent=2, sort_keys=True, default=str) + "\n")
    return chosen


async def _evaluate_and_promote(kafka, data: Split, candidate: str, publisher_url: str, sampler_url: str,
                                providers, out_dir: Path, opts: LoopOptions):
    """``fanroute eval`` then ``fanroute promote`` in-process; writes eval.json, the plot and decision.json."""
    from services.common.publisher_client import PublisherClient
    from services.evaluate.promote import decide, evidence, write_decision
    from services.evaluate.promote import render as render_decision
    from services.evaluate.report import write_json, write_plot
    from services.evaluate.run import EvalOptions, run_eval
    from services.judge.settings import JudgeSettings

    judge = JudgeSettings(kafka=kafka, redis=RedisSettings(url="memory://"), providers=providers)
    report = await run_eval(EvalOptions(
        train_episodes=data.train_file, candidate=candidate, deployed="auto", publisher_url=publisher_url,
        router_url=sampler_url, traces_file=data.traces_file, router_timeout_s=opts.router_timeout_s,
        router_max_tokens=opts.router_max_tokens, router_mode=opts.router_mode, cost_weight=opts.cost_weight,
        decision=opts.decision), judge)
    eval_dir = out_dir / "eval"
    print(f"report: {write_json(report, eval_dir)}\nplot:   {write_plot(report, eval_dir)}")
    decision = decide(report, eval_file=str(eval_dir / "eval.json"), max_router_p99_ms=opts.max_router_p99_ms)
    if decision.decision == "promote":
        model_id, version = candidate.split("@")

        def promote() -> dict:
            with PublisherClient(publisher_url) as client:
                return client.promote(model_id, int(version), fallback_provider=report.inputs.best_single.provider,
                                      evidence=evidence(report, decision))

        await asyncio.to_thread(promote)
        decision = decision.model_copy(update={"promoted": True})
    write_decision(decision, eval_dir)
    print(render_decision(decision), flush=True)
    return report, decision


async def _routed_traffic(kafka, redis, gateway_settings, sampler_url: str, publisher_url: str, report,
                          data: Split, opts: LoopOptions) -> int:
    """Held-out queries through a routed gateway; what came back, read from the traces topic."""
    from services.gateway.app import create_app
    from services.gateway.settings import RoutingSettings
    from services.providers.collections import ReplayQuery
    from services.tools.replay import replay
    from services.tools.traces import read_traces

    port = free_port()
    routing = RoutingSettings(enabled=True, model_id=MODEL_ID, router_url=sampler_url,
                              fanout_fraction=opts.fanout_fraction, router_timeout_s=opts.router_timeout_s,
                              mode=opts.router_mode, max_tokens=opts.router_max_tokens,
                              cost_weight=opts.cost_weight, decision=opts.decision, publisher_url=publisher_url,
                              fallback_provider=report.inputs.best_single.provider)
    settings = gateway_settings.model_copy(update={"port": port, "routing": routing, "redis": redis})
    queries = [ReplayQuery(t.query_id or t.trace_id, t.query) for t in data.held_out][:opts.routed_queries]
    print(f"      {len(queries)} queries at {opts.rate:g}/s, {opts.fanout_fraction:.0%} fan-out slice", flush=True)
    since = datetime.now(UTC)
    async with served(create_app(settings), port, what="routed gateway") as url:
        summary = await replay(url, queries, rate=opts.rate, concurrency=opts.concurrency, timeout_s=120)
    traces = [t async for t in read_traces(kafka, limit=len(queries), idle_s=30.0, since=since)]
    print(summary.render())
    print(render_routed(traces))
    return 0 if summary.ok == len(queries) and len(traces) == len(queries) else 1


def render_routed(traces: list[Trace]) -> str:
    """How the routed gateway answered: slice vs router vs fallback, calls, and nDCG@10 vs qrels."""
    from services.evaluate.policies import FUSED
    from services.evaluate.scoring import human_scores
    from services.judge.calibration.human import QrelsStore

    store = QrelsStore()
    paths: Counter[str] = Counter()
    ndcg: dict[str, list[float]] = {}
    calls: dict[str, list[int]] = {}
    for t in traces:
        if t.mode == "fanout":
            path, returned = "fan-out slice", FUSED
        else:
            assert t.route is not None
            path = f"fallback ({t.route.fallback})" if t.route.fallback else f"router {t.router_version}"
            returned = next((c.provider for c in t.candidates if c.ok), None)
        paths[path] += 1
        calls.setdefault(path, []).append(len(t.candidates))
        scores = human_scores(t, store)
        if scores is not None and returned is not None:
            ndcg.setdefault(path, []).append(scores.get(returned, 0.0))
    lines = [f"{'path':<28} {'requests':>8} {'calls/q':>8} {'nDCG@10 (qrels)':>16}"]
    for path, n in paths.most_common():
        mean = np.mean(ndcg[path]) if ndcg.get(path) else float("nan")
        lines.append(f"{path:<28} {n:>8} {np.mean(calls[path]):>8.2f} {mean:>16.3f}")
    return "\n".join(lines)
