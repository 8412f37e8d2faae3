"""``python -m services.gateway``: parse settings, then serve the gateway."""

from __future__ import annotations

import asyncio
import sys

from services.common.logging import setup_logging
from services.gateway.settings import GatewaySettings


async def run(settings: GatewaySettings) -> None:
    """Serve until interrupted."""
    import uvicorn

    from services.gateway.app import create_app

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve()


def main() -> int:
    """Parse settings (a bad one is a clear message and exit 2), then serve."""
    from pydantic import ValidationError

    from services.common.errors import ConfigError

    try:
        settings = GatewaySettings()
    except (ValidationError, ConfigError) as exc:
        print(f"fanroute gateway: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
