"""``python -m services.gateway``: parse settings, then serve the gateway."""

from __future__ import annotations

import sys

from services.common.entry import serve_app, service_main
from services.gateway.settings import GatewaySettings


async def run(settings: GatewaySettings) -> None:
    """Serve until interrupted."""
    from services.gateway.app import create_app

    await serve_app(create_app(settings), settings)


def main() -> int:
    return service_main("gateway", GatewaySettings, run)


if __name__ == "__main__":
    sys.exit(main())
