"""``fanroute demo``: the whole loop on the embedded default, on real Kafka and Redis.

Fan-out era: the gateway over the bundled collections, a replay of their development queries,
the traces read back from the topic and scored against the human qrels, the judge and the episode
builder on the topics. Then (services/tools/demo_loop.py) a short CPU SFT run, publish, evaluation
on held-out queries, promotion only if the student wins, and routed traffic through the gateway.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from schemas.trace import Trace
from services.common.settings import KafkaSettings
from services.providers.collections import default_collections_dir, sample_queries
from services.tools.memory import MemoryWatch
from services.tools.memory import render as render_memory
from services.tools.replay import replay
from services.tools.report import render, score_traces, write_report
from services.tools.serving import free_port, served
from services.tools.steps import step
from services.tools.traces import format_trace, read_traces

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo run."""

    queries: int | None = None  # None = every judged development query (677)
    rate: float = 8.0  # the dense providers embed each query on CPU: faster than this, latencies are queueing
    concurrency: int = 8
    seed: int = 0
    out_dir: Path = REPO / "out" / "demo"
    keep_stack: bool = False
    judge_rate: float = 1.0  # label every trace: the short training run needs them (the service default is 0.2)
    loop: bool = True  # False: stop after the fan-out era (no training, evaluation or routing)
    held_out_fraction: float = 0.3
    passes: int = 3  # chained one-pass training runs (each from the previous adapter, its own data order; a 4th:
    # docs/trainer.md)
    synthetic: int = 0  # pseudo-queries (fanroute traffic synth) replayed after the dev queries: training only
    select_pass: Literal["route", "last"] = "route"  # which pass is published (LoopOptions.select_pass)


STEPS = 8
#: The demo's own stack (free ports, fresh topics each run): `make stack-up`'s stack in .stack/ and the
#: demo never stop each other.
DEMO_STACK = REPO / ".stack" / "demo"
#: Where ``fanroute console`` answers with its default settings (loopback, port 8030).
CONSOLE_URL = "http://127.0.0.1:8030"


async def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns a process exit code. The doctor runs first; a failed step is one line
    naming the step, why, and the log file (``<out>/demo.log`` holds every record and traceback)."""
    from services.tools import doctor, steps

    steps.reset()
    findings = doctor.run_checks()
    if doctor.blocking(findings):
        print("fanroute demo: this machine is not ready (fanroute doctor):\n" + doctor.render(findings), flush=True)
        return 1
    log_file = opts.out_dir / "demo.log"
    with steps.logged_to(log_file):
        print(f"fanroute demo: doctor ok; full log in {log_file}", flush=True)
        watch = MemoryWatch()
        try:
            with watch:
                return await _run_demo(opts)
        except Exception as exc:  # noqa: BLE001 - one actionable line; the traceback is in the log file
            print(steps.failure_line(exc, log_file), file=sys.stderr, flush=True)
            return 1
        finally:
            jpath, ppath = watch.write(opts.out_dir)
            print(render_memory(watch.summary()) + f"\n  ({jpath}" + (f", {ppath})" if ppath else ")"), flush=True)


async def _run_demo(opts: DemoOptions) -> int:
    import devstack as stack

    _forget_console_store(opts.out_dir)
    started_stack = False
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("REDIS_URL") or os.environ.get("FANROUTE_REDIS__URL") or "memory://"
    if not bootstrap:
        step(1, STEPS, "starting Apache Kafka (KRaft) and redis-server on loopback ...")
        # Always on empty broker storage: a previous run's `adapters` records name versions (router@1, ...)
        # that this run's fresh Redis numbers again, and a new sampler would fetch those from a dead publisher.
        stack.down(DEMO_STACK, wipe=True)
        info = stack.up(DEMO_STACK, 0, 0, libs_dir=REPO / ".stack" / "kafka-libs")
        bootstrap, redis_url, started_stack = info.bootstrap_servers, info.redis_url, True
    print(f"      Kafka at {bootstrap}, Redis at {redis_url}", flush=True)
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    try:
        return await demo_on(opts, kafka, redis_url)
    finally:
        running = not started_stack or opts.keep_stack
        if not running:
            print(f"stopping the stack (use --keep-stack to leave it running in {DEMO_STACK})", flush=True)
            stack.down(DEMO_STACK)
        print(console_hint(kafka, redis_url, opts.out_dir, running=running), flush=True)


def console_store(out_dir: Path) -> Path:
    """The console's store for a demo's topics: beside the demo's results, not the console's default."""
    return out_dir / "console.sqlite3"


def _forget_console_store(out_dir: Path) -> None:
    """Drop a previous run's console store: its offsets are of topics this run wipes and writes anew."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{console_store(out_dir)}{suffix}").unlink(missing_ok=True)


def console_hint(kafka: KafkaSettings, redis_url: str, out_dir: Path, *, running: bool) -> str:
    """The exact ``fanroute console`` command over this run's topics and runs, and its URL.

    Printed, not started: the console would hold the demo's time budget and its stack."""
    env = {"FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "FANROUTE_REDIS__URL": redis_url,
           **({"FANROUTE_KAFKA__TOPIC_NAMESPACE": kafka.topic_namespace} if kafka.topic_namespace else {}),
           "FANROUTE_RUNS_DIR": str(out_dir), "FANROUTE_STORE_PATH": str(console_store(out_dir))}
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " fanroute console"
    lines = ["the operator console over this run's topics, runs and evaluations:", f"  {command}",
             f"  then open {CONSOLE_URL}"]
    if not running:
        lines.append("  (this run stopped its Kafka and Redis: run the demo with --keep-stack to browse its traces; "
                     "the runs and evaluations pages read only the files)")
    return "\n".join(lines)


async def demo_on(opts: DemoOptions, kafka: KafkaSettings, redis_url: str) -> int:
    """The demo against a running broker and Redis (``kafka`` carries the topic namespace, so a test
    can run it on fresh topics)."""
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(kafka=kafka, port=free_port(), require_kafka_at_start=True)  # it reads the traces back
    step(2, STEPS, f"starting the gateway (fan-out mode) with providers {[p.name for p in settings.providers]}"
         " (indexes are built once and cached; the first run builds them) ...")
    t0 = time.perf_counter()
    async with served(create_app(settings), settings.port, what="gateway") as url:
        print(f"      gateway ready at {url} in {time.perf_counter() - t0:.1f}s", flush=True)
        traces, code = await _traffic(opts, kafka, url)
    verdicts, episodes, wanted, gate = await _judge(kafka, redis_url, traces, settings.providers, opts)
    _release()  # the providers' and the judge's models: the trainer's process comes next
    code = code if len(verdicts) == wanted else 1
    from services.tools.demo_loop import LoopOptions, distill_and_route, split

    data = split(traces, episodes, opts.held_out_fraction, opts.out_dir)
    print(f"      split by query: {data.n_train} training episodes, {len(data.held_out)} held-out queries "
          f"({opts.held_out_fraction:.0%}) the student never sees (in {data.train_file} and {data.traces_file})",
          flush=True)
    if not opts.loop:
        return code
    loop = LoopOptions(held_out_fraction=opts.held_out_fraction, passes=opts.passes, allow_uncalibrated=not gate.open,
                       select_pass=opts.select_pass)
    return max(code, await distill_and_route(kafka, redis_url, data, settings, opts.out_dir, loop, 6, STEPS))


def _release() -> None:
    """Drop the dense models the fan-out era loaded and give the freed memory back to the kernel."""
    from services.common.rss import give_back, rss_mb
    from services.providers.index import release_models

    before = rss_mb()
    release_models()
    give_back()
    print(f"      memory: {before / 1024:.2f} -> {rss_mb() / 1024:.2f} GiB resident after releasing the "
          "fan-out era's models", flush=True)


async def _traffic(opts: DemoOptions, kafka: KafkaSettings, url: str) -> tuple[list[Trace], int]:
    queries = sample_queries(limit=opts.queries, seed=opts.seed)
    n_dev = len(queries)
    if opts.synthetic:
        from services.tools.traffic import synthesize

        synth, _ = synthesize(opts.synthetic, seed=opts.seed)
        queries = [*queries, *synth]
    since = datetime.now(UTC)
    extra = f" and {len(queries) - n_dev} synthetic ones (training only)" if len(queries) > n_dev else ""
    step(3, STEPS, f"replaying {n_dev} judged development queries{extra} at {opts.rate:g}/s; "
         "traces as they land on the Kafka topic:")
    traces: list[Trace] = []

    async def watch() -> None:
        async for t in read_traces(kafka, limit=len(queries), idle_s=60.0, since=since):
            traces.append(t)
            tqdm.write("  " + format_trace(t))

    watcher = asyncio.create_task(watch())
    summary = await replay(url, queries, rate=opts.rate, concurrency=opts.concurrency)
    try:
        await asyncio.wait_for(watcher, timeout=60)
    except TimeoutError:
        print(f"      only {len(traces)} of {len(queries)} traces arrived within 60 s")
    print("      replay summary\n" + summary.render(), flush=True)
    if traces:
        ov = np.percentile([t.signals.mean_overlap for t in traces], [10, 50, 90])
        n_contested = sum(t.signals.contested for t in traces)
        print(f"      mean citation overlap p10/p50/p90 = {ov[0]:.2f}/{ov[1]:.2f}/{ov[2]:.2f}; "
              f"contested (below {traces[0].signals.contested_threshold:g}): {n_contested}/{len(traces)}")
    rows = score_traces(traces, default_collections_dir())
    step(4, STEPS, f"{len(traces)} traces read back from Kafka\n" + render(rows, len(traces)))
    jpath, ppath = write_report(rows, opts.out_dir)
    print(f"report: {jpath}\nplot:   {ppath}")
    return traces, 0 if summary.ok == len(queries) and len(traces) == len(queries) else 1


async def _judge(kafka: KafkaSettings, redis_url: str, traces: list[Trace], providers,
                 opts: DemoOptions) -> tuple[list, list, int]:
    """Run the judge worker and the episode builder on the topics until this run's sampled
    traces have verdicts; then show the episodes, ATIF files and replay tasks they became.

    Returns the verdicts, the episodes, and how many verdicts were expected."""
    from schemas import Verdict, topic
    from services.common.bus import ensure_topics
    from services.common.replay_topic import read_messages
    from services.common.settings import RedisSettings
    from services.episodes.settings import EpisodeSettings
    from services.episodes.worker import run as run_builder
    from services.judge.calibrate import against_qrels
    from services.judge.calibration.metrics import render_report
    from services.judge.guard import guard
    from services.judge.sampling import sample_reason
    from services.judge.settings import JudgeSettings, build_backend
    from services.judge.worker import run, verdict_id

    out_dir = opts.out_dir
    settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis_url), providers=providers,
                             sample_rate=opts.judge_rate)
    guard(settings)
    backend = build_backend(settings.judge)
    wanted = {verdict_id(t.trace_id, backend, backend.rubric) for t in traces
              if sample_reason(t, settings.sample_rate) is not None}
    step(5, STEPS, f"judging: {len(wanted)} of {len(traces)} traces sampled (every contested one, "
         f"{settings.sample_rate:.0%} of the rest) by {backend.identity.model}")
    since = min((t.received_at for t in traces), default=None)
    await ensure_topics(kafka, [(n, topic(n)) for n in ("verdicts", "episodes", "tasks")])  # before reading
    stop = asyncio.Event()
    worker = asyncio.create_task(run(settings, stop))
    builder = asyncio.create_task(run_builder(EpisodeSettings(kafka=kafka, redis=settings.redis), stop))
    got: dict[str, Verdict] = {}
    # a first run embeds every source it reads (about 0.5 s a trace on 2 cores); later runs reuse the cache
    budget_s = max(180.0, 1.5 * len(wanted))
    bar = tqdm(total=len(wanted), desc="verdicts", unit="trace")
    try:
        try:
            async with asyncio.timeout(budget_s):
                async for v in read_messages(kafka, topic("verdicts"), Verdict, idle_s=budget_s, since=since):
                    if v.verdict_id in wanted and v.verdict_id not in got:
                        got[v.verdict_id] = v
                        bar.update(1)
                        if len(got) <= 3:
                            tqdm.write(f"  {v.trace_id[:12]} {v.sampled_because:<9} " + " > ".join(
                                " = ".join(tier) for tier in v.ordering))
                    if len(got) == len(wanted):
                        break
        except TimeoutError:
            print(f"      only {len(got)} of {len(wanted)} verdicts arrived within {budget_s:.0f} s")
        bar.close()
        n_ok = sum(v.status == "ok" for v in got.values())
        episodes, tasks = await _episodes(kafka, {t.trace_id for t in traces}, n_ok, out_dir)
    finally:
        stop.set()
        await worker
        await builder
    judged = {v.trace_id: v.ordering for v in got.values() if v.status == "ok"}
    report = against_qrels([t for t in traces if t.trace_id in judged], judged)
    print(render_report(report, f"{len(got)} verdicts on the topic; the judge vs the human qrels (all dev queries)"))
    gate = await _calibration_gate(kafka, backend, traces, judged, providers)
    print(f"episodes: {len(episodes)} (dataset + ATIF in {out_dir / 'episodes'}); replay tasks: {len(tasks)} "
          f"(in {out_dir / 'tasks'})")
    if tasks:
        from services.episodes.verifier import run_verifier

        task_dir, answer = tasks[0]
        result = run_verifier(task_dir, answer)
        print(f"  local verifier on {task_dir.name[:12]} with the judge's ordering: reward {result.reward} "
              f"({result.source})")
    return list(got.values()), episodes, len(wanted), gate


async def _calibration_gate(kafka: KafkaSettings, backend, traces: list[Trace], judged, providers):
    """The gate record from the judge's agreement with the qrels on the *validation half* only (its cut
    points were chosen on the tuning half), published on ``calibrations`` where the trainer looks."""
    from schemas import topic
    from services.common.bus import publish_once
    from services.common.splits import dev_half
    from services.judge.calibrate import against_qrels, record_for
    from services.judge.calibration.metrics import render_report

    val = [t for t in traces if t.trace_id in judged and dev_half(t.query_id or "") == "validation"]
    report = against_qrels(val, judged)
    names = [p.name for p in providers if p.enabled]
    record = record_for(report, backend, names, source="qrels", threshold=0.7)  # validation half only
    print(render_report(report, "the judge vs the human qrels on the validation half (the gate's figure)"))
    await publish_once(kafka, topic("calibrations"), record, client_id="fanroute-demo-calibrate")
    print(f"      calibration gate: tau-b {record.tau_b} vs {record.threshold} -> "
          f"{'OPEN' if record.open else 'CLOSED'} (published on the calibrations topic)", flush=True)
    return record


async def _episodes(kafka: KafkaSettings, trace_ids: set[str], n: int, out_dir: Path):
    """Wait for this run's ``n`` episodes and their tasks; write the dataset, ATIF files and tasks."""
    from schemas import Episode, Task, topic
    from services.common.dataset import write_jsonl
    from services.common.replay_topic import read_messages
    from services.episodes.atif import write_atif
    from services.episodes.tasks import write_task

    episodes: dict[str, Episode] = {}
    try:
        async with asyncio.timeout(120):
            async for ep in read_messages(kafka, topic("episodes"), Episode, idle_s=120):
                if ep.trace_id in trace_ids:
                    episodes[ep.episode_id] = ep
                if len(episodes) >= n:
                    break
    except TimeoutError:
        print(f"      only {len(episodes)} of {n} episodes arrived within 120 s")
    eps = [episodes[k] for k in sorted(episodes)]
    write_jsonl(eps, out_dir / "episodes" / "episodes.jsonl")
    for ep in eps:
        write_atif(ep, out_dir / "episodes" / "atif")
    answers = {ep.trace_id: ep.messages[2].content for ep in eps}
    tasks = []
    async for task in read_messages(kafka, topic("tasks"), Task, idle_s=3):
        if task.trace_id in answers:
            tasks.append((write_task(task, out_dir / "tasks"), answers[task.trace_id]))
    return eps, tasks
