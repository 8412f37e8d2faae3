"""``fanroute models prepare`` / ``python -m services.models prepare``: cache the embedded base model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.errors import ConfigError
from services.models.prepare import DEFAULT_BASE, MODELS_DIR_ENV, prepare_base


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("prepare", help=f"cache {DEFAULT_BASE} from the installed GGUF as safetensors")
    p.add_argument("--dir", type=Path, default=None,
                   help=f"target directory (default ${MODELS_DIR_ENV}/{DEFAULT_BASE}; see services.common.paths)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``models prepare [--dir DIR] [--force]`` on a subparsers object (``fanroute models ...``)."""
    parser = sub.add_parser("models", help="base models for training and sampling")
    _add_actions(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``fanroute models <action>``; 2 on a configuration problem."""
    try:
        path = prepare_base(args.dir, force=args.force)
    except ConfigError as exc:
        print(f"fanroute models: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.models prepare ...``."""
    parser = argparse.ArgumentParser(prog="python -m services.models", description=__doc__.splitlines()[0])
    _add_actions(parser)
    return run(parser.parse_args(argv))
