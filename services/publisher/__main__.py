"""``python -m services.publisher``: parse settings, then serve; ``... export ...`` exports a version."""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.logging import setup_logging
from services.publisher.settings import PublisherSettings


async def run(settings: PublisherSettings) -> None:
    """Serve until interrupted."""
    import uvicorn

    from services.publisher.app import create_app

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve()


def main(argv: list[str] | None = None) -> int:
    """Serve (a bad setting is a clear message and exit 2), or run ``export``."""
    from pydantic import ValidationError

    from services.publisher import export

    parser = argparse.ArgumentParser(prog="python -m services.publisher", description=__doc__)
    export.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(argv)
    if args.cmd == "export":
        setup_logging("WARNING")
        return export.run(args)
    try:
        settings = PublisherSettings()
    except ValidationError as exc:
        print(f"fanroute publisher: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
