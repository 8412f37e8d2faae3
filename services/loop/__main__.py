"""``python -m services.loop`` (``fanroute loop``): the continual loop's scheduler; flags first, see cli.py."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse the flags and settings, then run (``services.loop.cli.main``)."""
    from services.loop.cli import main as cli_main

    return cli_main(argv, prog)


if __name__ == "__main__":
    sys.exit(main())
