"""``fanroute calibrate ...``: report, export, import, mark, gate."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="judge vs human labels, and the calibration gate")
    cs = c.add_subparsers(dest="action", required=True)
    r = cs.add_parser("report", help="the configured judge vs the collections' qrels, or vs people's reviews")
    r.add_argument("--source", choices=("qrels", "reviews"), default="qrels",
                   help="qrels: fan the dev queries out and judge them (default); reviews: the agree/disagree marks "
                        "on the reviews topic (the console's), against the verdicts they mark")
    r.add_argument("--queries", type=int, default=None, help="at most this many dev queries (default: all of --half)")
    r.add_argument("--half", choices=("validation", "tune", "all"), default="validation",
                   help="which half of the dev queries (services.common.splits): the judge's cut points were "
                        "tuned on 'tune', so the honest figure is 'validation' (the default)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threshold", type=float, default=0.7, help="tau-b at or above which the gate opens")
    r.add_argument("--out", type=Path, default=Path("out/calibration/report.json"))
    r.add_argument("--publish", action="store_true", help="publish the gate record to Kafka")
    e = cs.add_parser("export", help="contested traces from Kafka, blind, for hand ranking")
    e.add_argument("--out", type=Path, required=True, help="CSV to write (a .key.csv goes beside it)")
    e.add_argument("--limit", type=int, default=200)
    e.add_argument("--seed", type=int, default=0)
    i = cs.add_parser("import", help="hand rankings vs this judge's verdicts; publishes the gate record")
    i.add_argument("rankings", type=Path)
    i.add_argument("--key", type=Path, default=None, help="letter key (default: beside the CSV)")
    i.add_argument("--threshold", type=float, default=0.7)
    m = cs.add_parser("mark", help="agree/disagree with one verdict")
    m.add_argument("verdict_id")
    m.add_argument("mark", choices=["agree", "disagree"])
    m.add_argument("--reviewer", required=True)
    m.add_argument("--note", default="")
    cs.add_parser("gate", help="is the configured judge's gate open? (exit 0 open, 1 closed/none)")


def run(args: argparse.Namespace) -> int:
    """Dispatch; a FanrouteError is a one-line message and exit 2."""
    from pydantic import ValidationError

    from services.common.errors import FanrouteError
    from services.judge.settings import JudgeSettings

    try:
        settings = JudgeSettings()
        return asyncio.run(_ACTIONS[args.action](settings, args))
    except (FanrouteError, ValidationError) as exc:
        print(f"fanroute calibrate {args.action}: {exc}", file=sys.stderr)
        return 2


async def _report(settings, args) -> int:
    from services.judge import calibrate as cal
    from services.judge.calibration.metrics import render_report
    from services.judge.settings import build_backend

    backend = build_backend(settings.judge)
    if args.source == "reviews":
        return await _report_reviews(settings, args, backend)
    await backend.start()
    try:
        traces = await cal.offline_traces(settings.providers, n=args.queries, seed=args.seed, contested_threshold=0.1,
                                          half=None if args.half == "all" else args.half)
        t0 = time.perf_counter()
        report = cal.against_qrels(traces, await cal.judge_tiers(backend, traces))
        seconds = time.perf_counter() - t0
    finally:
        await backend.close()
    names = [p.name for p in settings.providers if p.enabled]
    record = cal.record_for(report, backend, names, source="qrels", threshold=args.threshold)
    print(render_report(report, f"{backend.identity.model} vs qrels ({len(traces)} traces, {args.half} half of "
                                f"the dev queries)"))
    stats = getattr(backend, "embedding_stats", None)
    print(f"judge cost: {1000 * seconds / max(len(traces), 1):.0f} ms per trace on this CPU"
          + (f"; source embeddings computed {stats['embedded']}, from cache {stats['cached']}" if stats else ""))
    return await _gate_record(settings, args, report, record)


async def _gate_record(settings, args, report, record) -> int:
    """Say what the gate record decides, write the report beside it, publish it when asked."""
    from services.judge import calibrate as cal

    print(f"gate {record.gate_key}: tau-b {record.tau_b} vs threshold {record.threshold} -> "
          f"{'OPEN' if record.open else 'CLOSED'}")
    cal.write_json(report, record, args.out)
    print(f"wrote {args.out}")
    if args.publish:
        await _publish(settings, topic_name="calibrations", message=record)
    return 0


async def _report_reviews(settings, args, backend) -> int:
    """The gate recomputed from people's marks: each review's ordering against the verdict it marks."""
    from services.judge import calibrate as cal
    from services.judge.calibration.metrics import agreement_report, render_report
    from services.judge.calibration.reviews import read_review_pairs

    ident = backend.identity
    pairs, counts = await read_review_pairs(settings.kafka, (ident.kind, ident.model, backend.rubric))
    report = agreement_report(pairs)
    names = [p.name for p in settings.providers if p.enabled]
    record = cal.record_for(report, backend, names, source="reviews", threshold=args.threshold)
    print(counts.render())
    print(render_report(report, f"{ident.model} vs people's reviews ({len(pairs)} compared)"))
    return await _gate_record(settings, args, report, record)


async def _export(settings, args) -> int:
    from schemas.topics import topic
    from schemas.trace import Trace
    from services.common.replay_topic import read_messages
    from services.judge.calibration.files import export_blind

    contested = [t async for t in read_messages(settings.kafka, topic("traces"), Trace, idle_s=5)
                 if t.signals.contested]
    path, key = export_blind(contested, args.out, args.limit, args.seed)
    print(f"{min(args.limit, len(contested))} of {len(contested)} contested traces -> {path} (key: {key})")
    return 0


async def _import(settings, args) -> int:
    from services.judge import calibrate as cal
    from services.judge.calibration.files import default_key_path, import_rankings
    from services.judge.calibration.metrics import (
        TracePair,
        agreement_report,
        render_report,
    )
    from services.judge.settings import build_backend

    human = import_rankings(args.rankings, args.key or default_key_path(args.rankings))
    backend = build_backend(settings.judge)
    judged = await cal.verdict_tiers(settings.kafka, backend)
    pairs = [TracePair(tid, judged[tid], tiers) for tid, tiers in human.items() if tid in judged]
    report = agreement_report(pairs)
    names = [p.name for p in settings.providers if p.enabled]
    record = cal.record_for(report, backend, names, source="hand-ranked", threshold=args.threshold)
    print(render_report(report, f"{backend.identity.model} vs hand rankings "
                                f"({len(pairs)} of {len(human)} ranked traces have a verdict)"))
    await _publish(settings, topic_name="calibrations", message=record)
    print(f"gate {record.gate_key}: {'OPEN' if record.open else 'CLOSED'}")
    return 0


async def _mark(settings, args) -> int:
    from services.judge.calibrate import review

    await _publish(settings, topic_name="reviews", message=review(args.verdict_id, args.reviewer,
                                                                   args.mark, args.note))
    print(f"{args.mark} recorded for verdict {args.verdict_id}")
    return 0


async def _gate(settings, args) -> int:
    from schemas.calibration import gate_key
    from services.common.gates import latest_gate
    from services.judge.settings import build_backend

    backend = build_backend(settings.judge)
    ident = backend.identity
    key = gate_key(ident.kind, ident.model, backend.rubric, [p.name for p in settings.providers if p.enabled])
    rec = await latest_gate(settings.kafka, key)
    if rec is None:
        print(f"gate {key}: never calibrated (closed)")
        return 1
    print(f"gate {key}: tau-b {rec.tau_b} (n={rec.n}, {rec.human_source}, {rec.created_at:%Y-%m-%d}) "
          f"-> {'OPEN' if rec.open else 'CLOSED'}")
    return 0 if rec.open else 1


async def _publish(settings, *, topic_name: str, message) -> None:
    from schemas.topics import topic
    from services.common.bus import publish_once

    await publish_once(settings.kafka, topic(topic_name), message, client_id="fanroute-calibrate")


_ACTIONS = {"report": _report, "export": _export, "import": _import, "mark": _mark, "gate": _gate}
