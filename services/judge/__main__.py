"""``python -m services.judge``: parse settings, refuse a judge that is a provider, then consume."""

from __future__ import annotations

import sys

from services.common.entry import service_main
from services.judge.settings import JudgeSettings


async def run(settings: JudgeSettings) -> None:
    """Consume until SIGTERM/SIGINT (the worker and its clients import only now)."""
    from services.judge.worker import run as consume

    await consume(settings)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    def load() -> JudgeSettings:
        from services.judge.guard import guard

        settings = JudgeSettings()
        guard(settings)
        return settings

    return service_main("judge", load, run, refusal="refusing to start", argv=argv, settings_cls=JudgeSettings,
                        description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
