"""``fanroute demo``: the main job as far as it exists — real Kafka, the gateway over the bundled
collections, a replay of their queries, the traces read back from the topic, and a report
of what each provider (and the oracle, and full fan-out) scores against human qrels.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from schemas.trace import Trace
from services.common.settings import KafkaSettings
from services.gateway.providers.collections import default_collections_dir
from services.tools.replay import replay, sample_queries
from services.tools.report import render, score_traces, write_report
from services.tools.traces import format_trace, read_traces

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo run."""

    queries: int = 80
    rate: float = 10.0
    concurrency: int = 8
    seed: int = 0
    out_dir: Path = REPO / "out" / "demo"
    keep_stack: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns a process exit code."""
    from services.common import stack

    started_stack = False
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("REDIS_URL") or os.environ.get("FANROUTE_REDIS__URL") or "memory://"
    if not bootstrap:
        print("[1/6] starting Apache Kafka (KRaft) and redis-server on loopback ...", flush=True)
        info = stack.up(REPO / ".stack")
        bootstrap, redis_url, started_stack = info.bootstrap_servers, info.redis_url, True
    print(f"      Kafka at {bootstrap}, Redis at {redis_url}", flush=True)
    try:
        return await _demo(opts, KafkaSettings(bootstrap_servers=bootstrap), redis_url)
    finally:
        if started_stack and not opts.keep_stack:
            print("stopping the stack (use --keep-stack to leave it running)", flush=True)
            stack.down(REPO / ".stack")


async def _demo(opts: DemoOptions, kafka: KafkaSettings, redis_url: str) -> int:
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(kafka=kafka, port=_free_port())
    print(f"[2/6] starting the gateway with providers {[p.name for p in settings.providers]}"
          " (indexes are built once and cached; the first run builds them) ...", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port,
                                           log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve())
    t0 = time.perf_counter()
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("gateway exited during start-up")
        await asyncio.sleep(0.1)
    print(f"      gateway ready at http://127.0.0.1:{settings.port} in {time.perf_counter() - t0:.1f}s",
          flush=True)
    try:
        traces, code = await _traffic(opts, kafka, f"http://127.0.0.1:{settings.port}")
    finally:
        server.should_exit = True
        await serving
    verdicts = await _judge(kafka, redis_url, traces, settings.providers, opts.out_dir)
    return code if len(verdicts) == sum(_sampled(t) for t in traces) else 1


async def _traffic(opts: DemoOptions, kafka: KafkaSettings, url: str) -> tuple[list[Trace], int]:
    queries = sample_queries(limit=opts.queries, seed=opts.seed)
    since = datetime.now(UTC)
    print(f"[3/6] replaying {len(queries)} judged development queries at {opts.rate:g}/s; "
          "traces as they land on the Kafka topic:", flush=True)
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
    print("[4/6] replay summary\n" + summary.render(), flush=True)
    if traces:
        ov = np.percentile([t.signals.mean_overlap for t in traces], [10, 50, 90])
        n_contested = sum(t.signals.contested for t in traces)
        print(f"      mean citation overlap p10/p50/p90 = {ov[0]:.2f}/{ov[1]:.2f}/{ov[2]:.2f}; "
              f"contested (below {traces[0].signals.contested_threshold:g}): {n_contested}/{len(traces)}")
    rows = score_traces(traces, default_collections_dir())
    print(f"[5/6] {len(traces)} traces read back from Kafka\n" + render(rows, len(traces)), flush=True)
    jpath, ppath = write_report(rows, opts.out_dir)
    print(f"report: {jpath}\nplot:   {ppath}")
    return traces, 0 if summary.ok == len(queries) and len(traces) == len(queries) else 1


def _sampled(trace: Trace) -> bool:
    from services.judge.sampling import sample_reason
    from services.judge.settings import JudgeSettings

    return sample_reason(trace, JudgeSettings.model_fields["sample_rate"].default) is not None


async def _judge(kafka: KafkaSettings, redis_url: str, traces: list[Trace], providers, out_dir: Path) -> list:
    """Run the judge worker and the episode builder on the topics until this run's sampled
    traces have verdicts; then show the episodes, ATIF files and replay tasks they became."""
    from schemas import Verdict, topic
    from services.common.bus import ensure_topics
    from services.common.settings import RedisSettings
    from services.episodes.__main__ import run as run_builder
    from services.episodes.settings import EpisodeSettings
    from services.common.replay_topic import read_messages
    from services.judge.__main__ import guard, run
    from services.judge.calibrate import against_qrels
    from services.judge.calibration.metrics import render_report
    from services.judge.settings import JudgeSettings, build_backend
    from services.judge.worker import verdict_id

    settings = JudgeSettings(kafka=kafka, redis=RedisSettings(url=redis_url), providers=providers)
    guard(settings)
    backend = build_backend(settings.judge)
    wanted = {verdict_id(t.trace_id, backend, backend.rubric) for t in traces if _sampled(t)}
    print(f"[6/6] judging: {len(wanted)} of {len(traces)} traces sampled (every contested one, "
          f"{settings.sample_rate:.0%} of the rest) by {backend.identity.model}", flush=True)
    since = min((t.received_at for t in traces), default=None)
    await ensure_topics(kafka, [(n, topic(n)) for n in ("verdicts", "episodes", "tasks")])  # before reading
    stop = asyncio.Event()
    worker = asyncio.create_task(run(settings, stop))
    builder = asyncio.create_task(run_builder(EpisodeSettings(kafka=kafka, redis=settings.redis), stop))
    got: dict[str, Verdict] = {}
    try:
        try:
            async with asyncio.timeout(180):
                async for v in read_messages(kafka, topic("verdicts"), Verdict, idle_s=180, since=since):
                    if v.verdict_id in wanted:
                        got[v.verdict_id] = v
                        if len(got) <= 3:
                            tqdm.write(f"  {v.trace_id[:12]} {v.sampled_because:<9} " + " > ".join(
                                " = ".join(tier) for tier in v.ordering))
                    if len(got) == len(wanted):
                        break
        except TimeoutError:
            print(f"      only {len(got)} of {len(wanted)} verdicts arrived within 180 s")
        n_ok = sum(v.status == "ok" for v in got.values())
        episodes, tasks = await _episodes(kafka, {t.trace_id for t in traces}, n_ok, out_dir)
    finally:
        stop.set()
        await worker
        await builder
    judged = {v.trace_id: v.ordering for v in got.values() if v.status == "ok"}
    report = against_qrels([t for t in traces if t.trace_id in judged], judged)
    print(render_report(report, f"{len(got)} verdicts on the topic; the judge vs the human qrels"))
    print(f"episodes: {len(episodes)} (dataset + ATIF in {out_dir / 'episodes'}); replay tasks: {len(tasks)} "
          f"(in {out_dir / 'tasks'})")
    if tasks:
        from services.episodes.verifier import run_verifier

        task_dir, answer = tasks[0]
        result = run_verifier(task_dir, answer)
        print(f"  local verifier on {task_dir.name[:12]} with the judge's ordering: reward {result.reward} "
              f"({result.source})")
    return list(got.values())


async def _episodes(kafka: KafkaSettings, trace_ids: set[str], n: int, out_dir: Path):
    """Wait for this run's ``n`` episodes and their tasks; write the dataset, ATIF files and tasks."""
    from schemas import Episode, Task, topic
    from services.common.replay_topic import read_messages
    from services.episodes.atif import write_atif
    from services.episodes.dataset import write_jsonl
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
