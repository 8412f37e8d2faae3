"""``python -m services.rollouts``: parse settings (and refuse a runner that cannot mint), then run groups."""

from __future__ import annotations

import sys

from services.common.entry import service_main
from services.rollouts.settings import RolloutSettings


def load() -> RolloutSettings:
    """Settings, refused without the relay's admin token (no credential could be minted, no episode ended)."""
    from services.common.errors import ConfigError

    settings = RolloutSettings()
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        raise ConfigError("FANROUTE_ADMIN_TOKEN is not set: the runner mints credentials and ends episodes "
                          "through the relay's admin routes")
    return settings


async def run(settings: RolloutSettings) -> None:
    """Consume until SIGTERM/SIGINT (the worker and its clients import only now)."""
    from services.rollouts.worker import run as consume

    await consume(settings)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return service_main("rollouts", load, run, argv=argv, settings_cls=RolloutSettings, description=__doc__,
                        prog=prog)


if __name__ == "__main__":
    sys.exit(main())
