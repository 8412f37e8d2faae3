"""``fanroute dataset ...`` and ``fanroute tasks ...``: episodes as of a time, ATIF files, replay tasks."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path

from services.common.files import instant


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("dataset", help="the episode dataset as of a time, from the episodes topic")
    d.add_argument("--as-of", type=instant, default=None, help="ISO time (default: now)")
    d.add_argument("--out", type=Path, required=True, help="JSONL to write (canonical, sorted by id)")
    d.add_argument("--atif-dir", type=Path, default=None, help="also write one ATIF trajectory per episode")
    t = sub.add_parser("tasks", help="replay tasks (Harbor format)")
    ts = t.add_subparsers(dest="action", required=True)
    b = ts.add_parser("build", help="write every task on the tasks topic to a directory")
    b.add_argument("--out", type=Path, required=True)
    v = ts.add_parser("verify", help="run one task's verifier locally on an answer")
    v.add_argument("task_dir", type=Path)
    v.add_argument("--answer", default=None, help="the ordering line (omit: no answer file)")


def run(args: argparse.Namespace) -> int:
    from services.common.errors import FanrouteError
    from services.common.settings import ServiceSettings

    kafka = ServiceSettings().kafka
    try:
        if args.cmd == "dataset":
            return asyncio.run(_dataset(kafka, args))
        if args.action == "build":
            return asyncio.run(_build(kafka, args))
        return _verify(args)
    except FanrouteError as exc:
        print(f"fanroute {args.cmd}: {exc}", file=sys.stderr)
        return 2


async def _dataset(kafka, args) -> int:
    from services.common.dataset import dataset_as_of, write_jsonl
    from services.episodes.atif import write_atif

    as_of = args.as_of or datetime.now(UTC)
    episodes = await dataset_as_of(kafka, as_of)
    write_jsonl(episodes, args.out)
    print(f"{len(episodes)} episodes as of {as_of.isoformat()} -> {args.out}")
    if args.atif_dir:
        for ep in episodes:
            write_atif(ep, args.atif_dir)
        print(f"{len(episodes)} ATIF trajectories -> {args.atif_dir}")
    return 0


async def _build(kafka, args) -> int:
    from schemas.task import Task
    from schemas.topics import topic
    from services.common.replay_topic import read_topic
    from services.episodes.tasks import write_task

    n = 0
    # strict: a task record that does not decode stops the build, naming it (as before)
    async for task in read_topic(kafka, topic("tasks"), model=Task, strict=True):
        write_task(task, args.out)
        n += 1
    print(f"{n} task records -> {args.out} (content-addressed: unchanged tasks are rewritten identically)")
    return 0


def _verify(args) -> int:
    from services.episodes.verifier import run_verifier

    if not (args.task_dir / "tests" / "test.sh").is_file():
        print(f"fanroute tasks verify: {args.task_dir} has no tests/test.sh", file=sys.stderr)
        return 2
    result = run_verifier(args.task_dir, args.answer)
    print(f"reward {result.reward} from {result.source}{' (FLAGGED)' if result.flagged else ''}: {result.reason}")
    return 0
