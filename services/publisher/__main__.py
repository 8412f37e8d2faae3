"""``python -m services.publisher``: parse settings, then serve; ``... export ...`` exports a version."""

from __future__ import annotations

import argparse
import sys

from services.common.entry import app_main
from services.common.logging import setup_logging
from services.publisher.settings import PublisherSettings


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Serve (a bad setting is a clear message and exit 2), or run ``export``."""
    from services.publisher import cli

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        parser = argparse.ArgumentParser(prog=prog or "python -m services.publisher", description=__doc__)
        cli.add_export(parser.add_subparsers(dest="cmd"))
        args = parser.parse_args(argv)
        setup_logging("WARNING")
        return cli.run(args)
    return app_main("publisher", PublisherSettings, "services.publisher.app", argv=argv,
                    description=__doc__ + "\n`... export --help`: export a version instead of serving.", prog=prog)


if __name__ == "__main__":
    sys.exit(main())
