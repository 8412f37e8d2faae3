"""``python -m services.console``: parse settings, then serve the operator console."""

from __future__ import annotations

import sys

from services.common.entry import app_main
from services.console.settings import ConsoleSettings


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Serve (a bad setting is a clear message and exit 2)."""
    return app_main("console", ConsoleSettings, "services.console.app", argv=argv, description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
