"""``fanroute demo``, ``doctor``, ``replay``, ``traffic``, ``traces``, ``stack`` and ``market``: the commands that
compose services."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the composing commands on the top-level subparsers."""
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
    d.add_argument("--passes", type=int, default=None,
                   help="chained one-pass training runs, each starting from the previous adapter (1..5; "
                        "default: DemoOptions.passes, 3)")
    d.add_argument("--select-pass", choices=("route", "last"), default="route",
                   help="which pass is published: the one that routes best on the trainer's eval episodes (top "
                        "tier − λ·cost; stops early once a pass from the second on is worse), or the last")
    d.add_argument("--synthetic", type=int, default=0,
                   help="also replay this many synthetic queries (fanroute traffic synth; training only, never "
                        "held out): the large-traffic recipe")
    d.add_argument("--keep-stack", action="store_true", help="leave Kafka and Redis running after")
    d.add_argument("--market", choices=("federated", "nested"), default=None,
                   help="the provider market (default: FANROUTE_MARKET, else federated); nested is the control "
                        "where routing cannot pay, judged by the lexical local judge unless FANROUTE_JUDGE is set")
    d.set_defaults(func=_demo)

    doc = sub.add_parser("doctor", help="check what this machine has and lacks (Java, redis-server, bubblewrap, "
                                        "the model, caches, disk, memory, ports) and say what to run")
    doc.add_argument("--json", action="store_true", help="print the findings as JSON")
    doc.set_defaults(func=_doctor)

    r = sub.add_parser("replay", help="send the collections' queries through a running gateway")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    r.add_argument("--collections", default="all", help="comma-separated names, or 'all'")
    r.add_argument("--limit", type=int, default=None, help="at most this many queries")
    r.add_argument("--rate", type=float, default=5.0, help="requests per second (open loop)")
    r.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    r.add_argument("--seed", type=int, default=0, help="query order seed")
    r.add_argument("--json-out", type=Path, default=None, help="also write the summary as JSON")
    r.add_argument("--queries-file", type=Path, default=None,
                   help="send these queries instead ({query_id, text} JSONL, e.g. from fanroute traffic synth)")
    r.set_defaults(func=_replay)

    tr = sub.add_parser("traffic", help="synthetic traffic: pseudo-queries from the corpora (never a dev query) "
                                        "to replay through the gateway for more judged episodes")
    tr_actions = tr.add_subparsers(dest="action", required=True)
    syn = tr_actions.add_parser("synth", help="draw pseudo-queries (titles, leading words, key phrases) from the "
                                             "bundled corpora, seeded; write queries.jsonl and synth.json")
    syn.add_argument("--n", type=int, default=2000, help="how many queries")
    syn.add_argument("--seed", type=int, default=0, help="sampling seed")
    syn.add_argument("--mix", default=None,
                     help="share per collection, e.g. adi=1,cacm=2 (default 'dev': the judged dev queries' mix)")
    syn.add_argument("--out", type=Path, default=Path("out/traffic"), help="output directory")
    syn.set_defaults(func=_traffic)

    t = sub.add_parser("traces", help="print traces from the Kafka topic, one line each")
    t.add_argument("--limit", type=int, default=None, help="stop after this many")
    t.add_argument("--idle", type=float, default=5.0, help="stop after this many quiet seconds")
    t.set_defaults(func=_traces)

    s = sub.add_parser("stack", help="the local Kafka + Redis stack (no Docker)")
    s.add_argument("action", choices=["up", "down", "status", "prepare"])
    s.set_defaults(func=_stack)

    from services.providers.markets import MARKETS

    m = sub.add_parser("market", help="each market's providers, best single, per-domain best, oracle and "
                                      "judge-oracle on the dev queries (nDCG@10 vs qrels, cost per query)")
    m.add_argument("--market", choices=(*MARKETS, "all"), default="all")
    m.add_argument("--queries", type=int, default=None, help="first N dev queries (default: all 677)")
    m.add_argument("--no-judge", action="store_true", help="skip the judge-oracle row (faster)")
    m.add_argument("--out", type=Path, default=Path("out/market"))
    m.set_defaults(func=_market)

    rl = sub.add_parser("rl", help="the RL de-risking runs: preflight (non-model error rate), smoke, overfit")
    rl.add_argument("recipe", choices=("preflight", "smoke", "overfit"))
    rl.add_argument("--tasks-dir", type=Path, required=True, help="replay tasks (e.g. /tmp/demo-fed/tasks)")
    rl.add_argument("--out", type=Path, default=None, help="output directory (default out/rl-<recipe>)")
    for flag, kind, text in (("--steps", int, "optimizer steps"), ("--max-tasks", int, "tasks (preflight: all)"),
                             ("--max-tokens", int, "the harness's fixed max_tokens"),
                             ("--group-size", int, "rollouts per task"), ("--lr", float, "learning rate")):
        rl.add_argument(flag, type=kind, default=None, help=f"{text} (default: the recipe's)")
    rl.add_argument("--init-adapter", type=Path, default=None, help="start from this adapter (SFT or OPSD)")
    rl.add_argument("--engine", choices=("cpu", "vllm"), default="cpu",
                    help="what generates the rollouts: the CPU sampler, or the real vLLM server (its environment "
                         "from scripts/vllm-cpu.sh)")
    rl.set_defaults(func=_rl)

    ch = sub.add_parser("chain", help="SFT → OPSD → RL from a finished demo, every stage measured on the demo's "
                                      "held-out queries (fanroute eval) with its interval to the SFT start")
    ch.add_argument("--demo-dir", type=Path, default=Path("out/demo"), help="a finished `make demo` output")
    ch.add_argument("--out", type=Path, default=Path("out/chain"), help="chain.json, chain.md, chain.png, eval-*.json")
    ch.add_argument("--stages", type=_stages, default=None,
                    help="comma-separated, of sft,opsd,rl,opsd-rl (default: all; sft is always measured)")
    for flag, kind, text in (("--opsd-steps", _positive_int, "OPSD steps"), ("--opsd-lr", _positive_float, "OPSD lr"),
                             ("--opsd-anchor-coef", _non_negative_float, "OPSD KL anchor"),
                             ("--opsd-batch-size", _positive_int, "OPSD prompts per step"),
                             ("--rl-steps", _positive_int, "RL steps"), ("--rl-lr", _positive_float, "RL lr"),
                             ("--rl-groups-per-batch", _positive_int, "RL groups per step"),
                             ("--rl-eval-tasks", _positive_int, "held-out tasks per RL eval"),
                             ("--greedy-eval-max", _positive_int, "held-out episodes of the greedy eval")):
        ch.add_argument(flag, type=kind, default=None, help=f"{text} (default: services/tools/chain.py's)")
    ch.add_argument("--rl-reward", choices=("ndcg", "ndcg_cost"), default=None,
                    help="the runner's reward component (default ndcg)")
    ch.set_defaults(func=_chain)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _stages(text: str) -> tuple[str, ...]:
    from services.tools.chain import STAGES

    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {unknown or [text]}; choose from {', '.join(STAGES)}")
    return tuple(dict.fromkeys(("sft", *names)))


def _chain(args: argparse.Namespace) -> int:
    from services.common.errors import FanrouteError
    from services.tools.chain import ChainOptions, options_with, run_chain

    opts = options_with(ChainOptions(demo_dir=args.demo_dir, out_dir=args.out), stages=args.stages,
                        greedy_eval_max=args.greedy_eval_max, opsd_steps=args.opsd_steps, opsd_lr=args.opsd_lr,
                        opsd_anchor_coef=args.opsd_anchor_coef, opsd_batch_size=args.opsd_batch_size,
                        rl_steps=args.rl_steps, rl_lr=args.rl_lr, rl_groups_per_batch=args.rl_groups_per_batch,
                        rl_eval_tasks=args.rl_eval_tasks, rl_reward=args.rl_reward)
    try:
        summary = asyncio.run(run_chain(opts))
    except FanrouteError as exc:  # ChainInputError among them: the demo directory is not a finished demo
        print(f"fanroute chain: {exc}", file=sys.stderr)
        return 2
    return 1 if summary["errors"] else 0


def run(args: argparse.Namespace) -> int:
    """Run the parsed command (each parser names its handler)."""
    return args.func(args)


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM ends the demo like Ctrl-C does: the ``finally`` blocks stop its services and its stack."""
    raise SystemExit(128 + signum)


def _rl(args: argparse.Namespace) -> int:
    import json

    from services.common.errors import FanrouteError
    from services.tools.rl_recipes import main_async

    out = args.out or Path("out") / f"rl-{args.recipe}"
    try:
        summary = asyncio.run(main_async(args.recipe, args.tasks_dir, out, steps=args.steps, max_tasks=args.max_tasks,
                                         max_tokens=args.max_tokens, group_size=args.group_size, lr=args.lr,
                                         init_adapter=args.init_adapter, engine=args.engine))
    except FanrouteError as exc:
        print(f"fanroute rl {args.recipe}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=2, default=str))
    if args.recipe == "preflight" and summary["non_model_errors"]:
        return 1
    if args.recipe == "smoke" and all("skipped" in st for st in summary.get("steps", [])):
        print("fanroute rl smoke: nothing was trained: every group was uniform (each task's rollouts scored "
              "alike). The policy answers these tasks the same way every time: start from a less certain "
              "adapter, or pass --group-size 4", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    import os
    import signal

    from services.tools.demo import DemoOptions, run_demo

    if args.market is not None:  # every service of the demo reads its settings from the environment
        os.environ["FANROUTE_MARKET"] = args.market
        if args.market == "nested" and "FANROUTE_JUDGE" not in os.environ:
            # nested has dense providers embedding with the judge's model: the guard refuses that judge
            os.environ["FANROUTE_JUDGE"] = '{"type": "local"}'
            print("fanroute demo: market nested, judged by the lexical local judge", file=sys.stderr)
    if args.queries is not None and args.queries < 10 or not 0.05 <= args.held_out <= 0.9 \
            or args.passes is not None and not 1 <= args.passes <= 5 or not 0 <= args.synthetic <= 100_000:
        print("fanroute demo: --queries must be at least 10, --held-out within 0.05..0.9, --passes "
              "within 1..5 and --synthetic within 0..100000", file=sys.stderr)
        return 2
    opts = DemoOptions(queries=args.queries, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
                       keep_stack=args.keep_stack, loop=args.loop, held_out_fraction=args.held_out,
                       synthetic=args.synthetic, select_pass=args.select_pass,
                       **({"passes": args.passes} if args.passes is not None else {}),
                       **({"out_dir": args.out} if args.out else {}))
    before = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return asyncio.run(run_demo(opts))
    finally:
        signal.signal(signal.SIGTERM, before)


def _doctor(args: argparse.Namespace) -> int:
    from services.tools.doctor import main

    return main(as_json=args.json)


def _traffic(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from services.common.errors import FanrouteError
    from services.tools.traffic import parse_mix, synthesize, write

    try:
        queries, report = synthesize(args.n, seed=args.seed, mix=parse_mix(args.mix))
    except FanrouteError as exc:
        print(f"fanroute traffic synth: {exc}", file=sys.stderr)
        return 2
    path = write(queries, report, args.out)
    summary = {k: v for k, v in asdict(report).items() if k != "mix"}
    print(f"{report.queries} pseudo-queries -> {path} ({summary})")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from services.common.errors import FanrouteError
    from services.providers.collections import sample_queries
    from services.providers.config import ALL_COLLECTIONS
    from services.tools.replay import replay, write_summary

    names = ALL_COLLECTIONS if args.collections == "all" else tuple(args.collections.split(","))
    try:
        if args.queries_file is not None:
            from services.tools.traffic import read_queries_file

            queries = read_queries_file(args.queries_file)[:args.limit]
        else:
            queries = sample_queries(names, limit=args.limit, seed=args.seed)
        summary = asyncio.run(replay(args.url, queries, rate=args.rate, concurrency=args.concurrency))
    except FanrouteError as exc:
        print(f"fanroute replay: {exc}", file=sys.stderr)
        return 2
    print(summary.render())
    if args.json_out:
        write_summary(summary, args.json_out)
    return 0 if not summary.errors else 1


def _traces(args: argparse.Namespace) -> int:
    from services.common.settings import ServiceSettings
    from services.tools.traces import run_tail

    run_tail(ServiceSettings().kafka, args.limit, args.idle)
    return 0


def _stack(args: argparse.Namespace) -> int:
    import devstack

    return devstack.main([args.action])


def _market(args: argparse.Namespace) -> int:
    from services.tools.market import run

    return run(args)
