"""``fanroute loop demo``: the continual loop, time-compressed, on the real broker and Redis, with a provider
that degrades part-way.

Each *window* replays the development queries through a routed gateway (the promoted linear router decides,
a fixed slice keeps fanning out), the judge and the episode builder label the slice on the topics, and then
one loop cycle runs (:class:`services.loop.worker.Loop`, the code ``fanroute loop`` runs): dataset of the
window as of now → fit → publish → evaluate on the window's held-out slice → promote. From window
``--degrade-from`` a provider answers noise for most queries (``FANROUTE_DRIFT``); the slice's verdicts show it
(the drift score), and the next cycle's dataset teaches the router to leave it. Every window's live routed
quality is scored against the human qrels on the held-out queries (never trained on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOOP_STACK = REPO / ".stack" / "loop-demo"
MODEL_ID = "router"


@dataclass(frozen=True)
class LoopDemoOptions:
    windows: int = 3
    degrade: str = "web-lexical"
    keep: float = 0.2
    degrade_from: int = 2
    fanout_fraction: float = 0.5
    rate: float = 10.0
    concurrency: int = 8
    queries: int | None = None
    held_out_fraction: float = 0.3
    seed: int = 0
    out_dir: Path = REPO / "out" / "loop-demo"
    keep_stack: bool = False
    min_new_episodes: int = 50


@dataclass
class Row:
    """One window and the cycle after it."""

    window: int
    degraded: bool
    queries: int
    slice_traces: int
    routed: int
    router: str
    routed_ndcg: float | None
    degraded_share: float | None
    drift: float | None
    drift_triggered: bool
    drift_worst: str | None
    cycle_phase: str
    episodes: int | None
    adapter_out: str | None
    candidate_ndcg: float | None
    candidate_degraded_share: float | None
    decision: str | None
    cycle_s: float
    window_s: float


def parse(argv: list[str], prog: str) -> LoopDemoOptions:
    d = LoopDemoOptions()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=d.windows, help="traffic windows, each followed by a cycle")
    p.add_argument("--degrade", default=d.degrade, help="the provider that degrades")
    p.add_argument("--keep", type=float, default=d.keep, help="share of its answers that stay real once degraded")
    p.add_argument("--degrade-from", type=int, default=d.degrade_from, help="the first degraded window (1-based)")
    p.add_argument("--fanout-fraction", type=float, default=d.fanout_fraction, help="the slice that keeps fanning out")
    p.add_argument("--rate", type=float, default=d.rate, help="queries per second")
    p.add_argument("--queries", type=int, default=None, help="development queries per window (default: all)")
    p.add_argument("--out", type=Path, default=d.out_dir, help="results directory")
    p.add_argument("--keep-stack", action="store_true", help="leave Kafka and Redis running")
    a = p.parse_args(argv)
    for name, ok in (("windows", a.windows >= 2), ("keep", 0 <= a.keep <= 1), ("rate", a.rate > 0),
                     ("degrade-from", 1 <= a.degrade_from <= a.windows), ("queries", a.queries is None or a.queries >= 20),
                     ("fanout-fraction", 0 < a.fanout_fraction <= 1)):
        if not ok:
            p.error(f"--{name}: out of range ({getattr(a, name.replace('-', '_'))})")
    return LoopDemoOptions(windows=a.windows, degrade=a.degrade, keep=a.keep, degrade_from=a.degrade_from,
                           fanout_fraction=a.fanout_fraction, rate=a.rate, queries=a.queries, out_dir=a.out,
                           keep_stack=a.keep_stack)


def main(argv: list[str] | None = None, prog: str = "fanroute loop demo") -> int:
    opts = parse(list(sys.argv[1:] if argv is None else argv), prog)
    from services.common.logging import setup_logging
    from services.providers.markets import default_providers

    if opts.degrade not in {p.name for p in default_providers()}:
        print(f"{prog}: --degrade: no provider {opts.degrade!r} in the federated market", file=sys.stderr)
        return 2
    from services.tools import steps

    setup_logging("WARNING")
    log_file = opts.out_dir.parent / f"{opts.out_dir.name}.log"
    with steps.logged_to(log_file):
        print(f"fanroute loop demo: full log in {log_file}", flush=True)
        return asyncio.run(run_loop_demo(opts))


async def run_loop_demo(opts: LoopDemoOptions) -> int:
    import devstack as stack

    from services.common.settings import KafkaSettings

    bootstrap = os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("FANROUTE_REDIS__URL")
    started = False
    if not bootstrap or not redis_url:
        print("starting Apache Kafka (KRaft) and redis-server on loopback (fresh topics) ...", flush=True)
        stack.down(LOOP_STACK, wipe=True)
        info = stack.up(LOOP_STACK, 0, 0, libs_dir=REPO / ".stack" / "kafka-libs")
        bootstrap, redis_url, started = info.bootstrap_servers, info.redis_url, True
    try:
        return await demo_on(opts, KafkaSettings(bootstrap_servers=bootstrap), redis_url)
    finally:
        if started and not opts.keep_stack:
            stack.down(LOOP_STACK)


async def demo_on(opts: LoopDemoOptions, kafka, redis_url: str) -> int:
    """The demo against a running broker and Redis (``kafka`` carries the topic namespace: a test runs it on
    fresh topics)."""
    import shutil

    from services.common.settings import RedisSettings
    from services.episodes.settings import EpisodeSettings
    from services.episodes.worker import run as run_builder
    from services.judge.settings import JudgeSettings
    from services.judge.worker import run as run_judge
    from services.loop.settings import LoopSettings
    from services.providers.markets import default_providers
    from services.publisher.app import create_app as publisher_app
    from services.publisher.settings import PublisherSettings
    from services.tools.serving import free_port, served

    redis = RedisSettings(url=redis_url)
    shutil.rmtree(opts.out_dir, ignore_errors=True)
    opts.out_dir.mkdir(parents=True)
    providers = default_providers()
    pport = free_port()
    pub = PublisherSettings(kafka=kafka, redis=redis, port=pport, storage_dir=opts.out_dir / "publisher",
                            public_url=f"http://127.0.0.1:{pport}")
    judge = JudgeSettings(kafka=kafka, redis=redis, providers=providers, sample_rate=1.0)
    rows: list[Row] = []
    async with served(publisher_app(pub), pport, what="publisher") as publisher_url:
        settings = LoopSettings(kafka=kafka, redis=redis, publisher_url=publisher_url, kind="linear",
                                model_id=MODEL_ID, once=True, min_new_episodes=opts.min_new_episodes,
                                held_out_fraction=opts.held_out_fraction, work_dir=opts.out_dir / "cycles",
                                bootstrap=1000, drift_min_verdicts=20)
        stop = asyncio.Event()
        workers = [asyncio.create_task(run_judge(judge, stop)),
                   asyncio.create_task(run_builder(EpisodeSettings(kafka=kafka, redis=redis), stop))]
        try:
            fallback = "web-lexical"
            for w in range(1, opts.windows + 1):
                row, fallback = await _window(opts, w, kafka, redis, publisher_url, settings, fallback)
                rows.append(row)
                _write(rows, opts)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
    print(render(rows, opts), flush=True)
    return 0


async def _window(opts, w: int, kafka, redis, publisher_url: str, base_settings, fallback: str):
    """One traffic window through a routed gateway, its labels, then one cycle. Returns its row and the
    fallback provider the next window's gateway uses when nothing is promoted."""
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings, RoutingSettings
    from services.loop.worker import Loop, render as render_record
    from services.providers.collections import sample_queries
    from services.tools.replay import replay
    from services.tools.serving import free_port, served
    from services.tools.traces import read_traces

    degraded = w >= opts.degrade_from
    t_window = time.perf_counter()
    started = datetime.now(UTC)
    queries = sample_queries(limit=opts.queries, seed=opts.seed + w)
    routing = RoutingSettings(enabled=True, kind="linear", model_id=MODEL_ID, publisher_url=publisher_url,
                              fanout_fraction=opts.fanout_fraction, fallback_provider=fallback)
    port = free_port()
    gateway = GatewaySettings(kafka=kafka, redis=redis, port=port, routing=routing, spool_dir=opts.out_dir / "spool",
                              drift=f"{opts.degrade}:{opts.keep}@{started.isoformat()}" if degraded else None)
    state = f"{opts.degrade} DEGRADED (keeps {opts.keep:.0%})" if degraded else "all providers healthy"
    print(f"\n== window {w}/{opts.windows}: {len(queries)} queries at {opts.rate:g}/s, "
          f"{opts.fanout_fraction:.0%} fan-out slice, {state}", flush=True)
    async with served(create_app(gateway), port, what="gateway") as url:
        summary = await replay(url, queries, rate=opts.rate, concurrency=opts.concurrency, progress=False)
    traces = [t async for t in read_traces(kafka, limit=len(queries), idle_s=30.0, since=started)]
    print(f"   {summary.ok}/{len(queries)} answered; {len(traces)} traces", flush=True)
    await _labels(kafka, traces, started)
    live = _live(traces, opts)
    loop = Loop(base_settings.model_copy(update={"dataset_window_s": (datetime.now(UTC) - started).total_seconds()}))
    await loop.start()
    try:
        t0 = time.perf_counter()
        history = await loop.history()
        drift = await loop.drift(history, datetime.now(UTC))
        record = await loop.run_slot(datetime.now(UTC).replace(microsecond=0), "drift" if drift.triggered else "demo")
        cycle_s = time.perf_counter() - t0
    finally:
        await loop.stop()
    assert record is not None
    print("   " + render_record(record), flush=True)
    measured = record.drift or drift  # what the cycle recorded at its start (the topic's figure)
    f = record.figures
    row = Row(window=w, degraded=degraded, queries=len(queries), slice_traces=live["slice"], routed=live["routed"],
              router=live["router"], routed_ndcg=live["ndcg"], degraded_share=live["share"],
              drift=measured.score, drift_triggered=measured.triggered, drift_worst=measured.worst, cycle_phase=record.phase,
              episodes=record.episodes, adapter_out=record.adapter_out, candidate_ndcg=f.get("candidate/human"),
              candidate_degraded_share=f.get(f"share/{opts.degrade}", 0.0 if f else None), decision=record.decision,
              cycle_s=round(cycle_s, 1), window_s=round(time.perf_counter() - t_window, 1))
    eval_file = base_settings.work_dir / record.cycle_id / "eval" / "eval.json"
    if eval_file.is_file():
        fallback = json.loads(eval_file.read_text())["inputs"]["best_single"]["provider"]
    return row, fallback


async def _labels(kafka, traces, since: datetime) -> None:
    """Wait until the judge has a verdict for every trace of the window and the builder an episode for
    every fan-out one it judged ok (bounded; what is missing is said)."""
    from schemas import Episode, Verdict, topic
    from services.common.replay_topic import read_messages

    ids = {t.trace_id for t in traces}
    fanout = {t.trace_id for t in traces if t.mode == "fanout"}
    budget = max(180.0, 1.0 * len(ids))
    ok: set[str] = set()
    got: set[str] = set()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(budget):
            async for v in read_messages(kafka, topic("verdicts"), Verdict, idle_s=budget, since=since):
                if v.trace_id in ids:
                    got.add(v.trace_id)
                    if v.status == "ok" and v.trace_id in fanout:
                        ok.add(v.trace_id)
                if got >= ids:
                    break
    except TimeoutError:
        print(f"   only {len(got)} of {len(ids)} verdicts within {budget:.0f} s", flush=True)
    built: set[str] = set()
    try:
        async with asyncio.timeout(120):
            async for ep in read_messages(kafka, topic("episodes"), Episode, idle_s=120, since=since):
                if ep.trace_id in ok:
                    built.add(ep.trace_id)
                if built >= ok:
                    break
    except TimeoutError:
        print(f"   only {len(built)} of {len(ok)} episodes within 120 s", flush=True)
    print(f"   labelled: {len(got)} verdicts ({len(ok)} on the fan-out slice), {len(built)} episodes in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def _live(traces, opts) -> dict:
    """The window's routed traffic on held-out queries: nDCG@10 vs qrels, and the degraded provider's share."""
    from services.evaluate.scoring import human_scores
    from services.judge.calibration.human import QrelsStore
    from services.router.policy import held_out

    store = QrelsStore()
    routed = [t for t in traces if t.mode == "routed"]
    picks = Counter(next((c.provider for c in t.candidates if c.ok), None) for t in routed)
    scores = []
    for t in routed:
        if not held_out(t.query_id or t.query, opts.held_out_fraction):
            continue
        returned = next((c.provider for c in t.candidates if c.ok), None)
        s = human_scores(t, store)
        if s is not None and returned is not None:
            scores.append(s.get(returned, 0.0))
    routers = Counter(t.router_version or (f"fallback ({t.route.fallback})" if t.route and t.route.fallback else "-")
                      for t in routed)
    return {"slice": len(traces) - len(routed), "routed": len(routed),
            "router": ", ".join(f"{k} {v}" for k, v in routers.most_common(2)),
            "ndcg": round(sum(scores) / len(scores), 4) if scores else None,
            "share": round(picks[opts.degrade] / len(routed), 4) if routed else None}


def render(rows: list[Row], opts: LoopDemoOptions) -> str:
    head = (f"{'win':>3} {'state':<9} {'routed by':<28} {'live nDCG':>9} {opts.degrade + ' share':>17} "
            f"{'drift':>6} {'cycle':<9} {'episodes':>8} {'candidate':<10} {'cand nDCG':>9} {'cand share':>10} decision")
    lines = [f"the loop over {len(rows)} windows ({opts.degrade} degraded from window {opts.degrade_from}; live nDCG@10 "
             "of the routed held-out queries against the human qrels):", head]
    for r in rows:
        def f(x, p=3):
            return "-" if x is None else f"{x:.{p}f}"
        lines.append(f"{r.window:>3} {'degraded' if r.degraded else 'healthy':<9} {r.router[:28]:<28} "
                     f"{f(r.routed_ndcg):>9} {f(r.degraded_share):>17} {f(r.drift):>6} {r.cycle_phase:<9} "
                     f"{r.episodes if r.episodes is not None else '-':>8} {r.adapter_out or '-':<10} "
                     f"{f(r.candidate_ndcg):>9} {f(r.candidate_degraded_share):>10} {r.decision or '-'}")
    return "\n".join(lines)


def _write(rows: list[Row], opts: LoopDemoOptions) -> None:
    """rows.json and the plot: live routed nDCG and the degraded provider's share per window."""
    (opts.out_dir / "loop-demo.json").write_text(json.dumps(
        {"options": {k: str(v) for k, v in asdict(opts).items()}, "rows": [asdict(r) for r in rows]}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r.window for r in rows]
    ax.plot(xs, [r.routed_ndcg for r in rows], "o-", label="live routed nDCG@10 (held-out, qrels)")
    ax.plot(xs, [r.degraded_share for r in rows], "s--", label=f"{opts.degrade}'s share of routed traffic")
    ax.plot(xs, [r.drift for r in rows], "^:", label="drift score (slice)")
    ax.axvline(opts.degrade_from - 0.5, color="grey", lw=0.8)
    ax.set_xlabel("window (a cycle runs after each)")
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(opts.out_dir / "loop-demo.png", dpi=120)
    plt.close(fig)
