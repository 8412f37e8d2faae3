"""The ``fanroute`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fanroute", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("gateway", help="serve the fan-out gateway (same as python -m services.gateway)")

    d = sub.add_parser("demo", help="the whole loop on the embedded default: fan out, judge, distill, "
                                    "evaluate, promote if better, route")
    d.add_argument("--queries", type=int, default=None,
                   help="how many development queries to replay (default: all 677 judged ones)")
    d.add_argument("--rate", type=float, default=8.0, help="fan-out requests per second")
    d.add_argument("--concurrency", type=int, default=8, help="fan-out requests in flight at most")
    d.add_argument("--seed", type=int, default=0, help="query sampling seed")
    d.add_argument("--held-out", type=float, default=0.3,
                   help="share of queries (by hash of the query id) the student never trains on")
    d.add_argument("--no-loop", dest="loop", action="store_false",
                   help="stop after the fan-out era (no training, evaluation, promotion or routing)")
    d.add_argument("--out", type=Path, default=None, help="report directory (default out/demo)")
    d.add_argument("--keep-stack", action="store_true", help="leave Kafka and Redis running after")

    r = sub.add_parser("replay", help="send the collections' queries through a running gateway")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    r.add_argument("--collections", default="all", help="comma-separated names, or 'all'")
    r.add_argument("--limit", type=int, default=None, help="at most this many queries")
    r.add_argument("--rate", type=float, default=5.0, help="requests per second (open loop)")
    r.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    r.add_argument("--seed", type=int, default=0, help="query order seed")
    r.add_argument("--json-out", type=Path, default=None, help="also write the summary as JSON")

    t = sub.add_parser("traces", help="print traces from the Kafka topic, one line each")
    t.add_argument("--limit", type=int, default=None, help="stop after this many")
    t.add_argument("--idle", type=float, default=5.0, help="stop after this many quiet seconds")

    s = sub.add_parser("stack", help="the local Kafka + Redis stack (no Docker)")
    s.add_argument("action", choices=["up", "down", "status", "prepare"])

    sub.add_parser("judge", help="run the judge worker (same as python -m services.judge)")
    from services.episodes.cli import add_parser as add_episodes
    from services.importer.run import add_parser as add_import
    from services.judge.cli import add_parser as add_calibrate
    from services.publisher.export import add_parser as add_export

    add_calibrate(sub)
    add_episodes(sub)
    add_import(sub)
    ad = sub.add_parser("adapters", help="published adapters: export as a PEFT dir or a merged model")
    add_export(ad.add_subparsers(dest="action", required=True))
    sub.add_parser("publisher", help="serve the adapter publisher (same as python -m services.publisher)")
    sub.add_parser("sampler", help="serve the CPU sampler (same as python -m services.sampler)")
    from services.models.prepare import add_parser as add_models
    from services.trainer.__main__ import add_parser as add_train

    add_models(sub)
    add_train(sub)
    from services.evaluate.cli import add_parser as add_evaluate

    add_evaluate(sub)
    from services.tools.market import add_parser as add_market

    add_market(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from services.common.logging import setup_logging

    if args.cmd == "gateway":
        from services.gateway.__main__ import main as gateway_main

        return gateway_main()
    if args.cmd == "judge":
        from services.judge.__main__ import main as judge_main

        return judge_main()
    if args.cmd == "episodes":
        from services.episodes.__main__ import main as episodes_main

        return episodes_main()
    setup_logging("WARNING")
    if args.cmd == "sampler":
        from services.sampler.__main__ import main as sampler_main

        return sampler_main()
    if args.cmd == "models":
        from services.models.prepare import run as models_run

        return models_run(args)
    if args.cmd == "train":
        from services.trainer.__main__ import run as train_run

        return train_run(args)
    if args.cmd in ("eval", "promote"):
        from services.evaluate.cli import run as evaluate_run

        return evaluate_run(args)
    if args.cmd == "market":
        from services.tools.market import run as market_run

        return market_run(args)
    if args.cmd == "publisher":
        from services.publisher.__main__ import main as publisher_main

        return publisher_main()
    if args.cmd == "adapters":
        from services.publisher.export import run as export_run

        return export_run(args)
    if args.cmd == "import":
        from services.importer.run import run as import_run

        return import_run(args)
    if args.cmd in ("dataset", "tasks"):
        from services.episodes.cli import run as episodes_cli

        return episodes_cli(args)
    if args.cmd == "calibrate":
        from services.judge.cli import run as calibrate

        return calibrate(args)
    if args.cmd == "stack":
        import devstack as stack

        return stack.main([args.action])
    if args.cmd == "traces":
        from services.common.settings import ServiceSettings
        from services.tools.traces import run_tail

        run_tail(ServiceSettings().kafka, args.limit, args.idle)
        return 0
    if args.cmd == "replay":
        return _replay(args)
    from services.tools.demo import DemoOptions, run_demo

    if args.queries is not None and args.queries < 10 or not 0.05 <= args.held_out <= 0.9:
        print("fanroute demo: --queries must be at least 10 and --held-out within 0.05..0.9", file=sys.stderr)
        return 2
    opts = DemoOptions(queries=args.queries, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
                       keep_stack=args.keep_stack, loop=args.loop, held_out_fraction=args.held_out,
                       **({"out_dir": args.out} if args.out else {}))
    return asyncio.run(run_demo(opts))


def _replay(args: argparse.Namespace) -> int:
    from services.common.errors import FanrouteError
    from services.providers.config import ALL_COLLECTIONS
    from services.tools.replay import replay, sample_queries, write_summary

    names = ALL_COLLECTIONS if args.collections == "all" else tuple(args.collections.split(","))
    try:
        queries = sample_queries(names, limit=args.limit, seed=args.seed)
        summary = asyncio.run(replay(args.url, queries, rate=args.rate, concurrency=args.concurrency))
    except FanrouteError as exc:
        print(f"fanroute replay: {exc}", file=sys.stderr)
        return 2
    print(summary.render())
    if args.json_out:
        write_summary(summary, args.json_out)
    return 0 if not summary.errors else 1


if __name__ == "__main__":
    sys.exit(main())
