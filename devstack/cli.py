"""The ``python -m devstack`` command line: ``up``, ``status``, ``down``, ``prepare``.

``up`` prints progress on stderr and ``export NAME=value`` lines on stdout, so
``eval "$(python -m devstack up)"`` points a shell at the stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from devstack.base import COMPONENTS, DEFAULT_STATE_DIR, StackError, StackInfo, _say
from devstack.jars import prepare
from devstack.stack import down, status, up

PROG = "python -m devstack"
DESCRIPTION = "Local Kafka (KRaft, from Maven jars) + redis-server."
COMMANDS = ("up", "down", "status", "prepare")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command and its options, on any parser."""
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help="where jars, data, logs, pid files and stack.json live (default: %(default)s)")
    parser.add_argument("--kafka-port", type=int, default=None, help="Kafka port (0 = any free)")
    parser.add_argument("--redis-port", type=int, default=None, help="Redis port (0 = any free)")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("--wipe", action="store_true", help="down: also delete the broker data")
    return parser


def add_parser(sub: argparse._SubParsersAction, name: str = "stack") -> argparse.ArgumentParser:
    """Register the stack commands on a subparsers object (e.g. ``fanroute stack ...``)."""
    return add_arguments(sub.add_parser(name, help="the local Kafka + Redis stack (no Docker)",
                                        description=DESCRIPTION))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog, description=DESCRIPTION))


def _print_env(info: StackInfo) -> None:
    for key, value in info.env().items():
        print(f"export {key}={value}")


def run(args: argparse.Namespace) -> int:
    """Run one parsed command; 0 done (``status``: both running and answering), 1 otherwise."""
    try:
        if args.command == "prepare":
            libs = prepare(args.state_dir)
            _say(f"Kafka jars ready in {libs}")
        elif args.command == "up":
            started = time.monotonic()
            info = up(args.state_dir, args.kafka_port, args.redis_port)
            took = time.monotonic() - started
            _say(f"stack up in {took:.1f} s (state in {Path(args.state_dir).resolve()})")
            _print_env(info)
        elif args.command == "down":
            down(args.state_dir, wipe=args.wipe)
            _say("stack down")
        else:
            st = status(args.state_dir)
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                for name in COMPONENTS:
                    c = st[name]
                    what = (f"running, {'answering' if c['answering'] else 'NOT answering'} at "
                            f"{c['endpoint']} (pid {c['pid']})") if c["running"] else "stopped"
                    print(f"{name}: {what}")
            return 0 if all(st[n]["running"] and st[n]["answering"] for n in COMPONENTS) else 1
    except StackError as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), then run."""
    return run(build_parser().parse_args(argv))
