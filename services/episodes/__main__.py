"""``python -m services.episodes``: parse settings, then join traces and verdicts into episodes."""

from __future__ import annotations

import sys

from services.common.entry import service_main
from services.episodes.settings import EpisodeSettings


async def run(settings: EpisodeSettings) -> None:
    """Consume until SIGTERM/SIGINT (the worker and its clients import only now)."""
    from services.episodes.worker import run as consume

    await consume(settings)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return service_main("episodes", EpisodeSettings, run, argv=argv, description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
