"""``python -m devstack up|status|down|prepare``: parse the arguments, then run the command."""

from __future__ import annotations

import sys

from devstack.cli import build_parser, run

if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
