"""``python -m services.gateway``: parse settings, then serve the gateway."""

from __future__ import annotations

import asyncio

from services.common.logging import setup_logging
from services.gateway.settings import GatewaySettings


async def run(settings: GatewaySettings) -> None:
    """Serve until interrupted."""
    import uvicorn

    from services.gateway.app import create_app

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve()


def main() -> None:
    settings = GatewaySettings()
    setup_logging(settings.log_level)
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
