"""``python -m services.sampler``: parse settings, then load the base model once and serve."""

from __future__ import annotations

import asyncio
import sys

from services.common.logging import setup_logging
from services.sampler.settings import SamplerSettings


async def run(settings: SamplerSettings) -> None:
    """Serve until interrupted (torch and the model load inside the app's lifespan)."""
    import uvicorn

    from services.sampler.app import create_app

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve()


def main() -> int:
    """Parse settings (a bad one is a clear message and exit 2), then serve."""
    from pydantic import ValidationError

    from services.common.errors import ConfigError

    try:
        settings = SamplerSettings()
    except (ValidationError, ConfigError) as exc:
        print(f"fanroute sampler: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
