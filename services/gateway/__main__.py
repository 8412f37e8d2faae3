"""``python -m services.gateway``: parse settings, then serve the gateway (``app.py``); with
``FANROUTE_WORKERS=N`` a supervisor runs N gateway processes on the one port (``workers.py``)."""

from __future__ import annotations

import sys

from services.common.entry import service_main
from services.gateway.settings import GatewaySettings


async def run(settings: GatewaySettings) -> None:
    """One gateway, a worker of several on a shared port, or the supervisor of ``settings.workers``."""
    from services.common.entry import serve_app

    if settings.workers > 1 and settings.worker_index is None:
        from services.gateway.workers import supervise

        status = await supervise(settings)
        if status:
            raise SystemExit(status)
        return
    from services.gateway.app import create_app

    sock = None
    if settings.worker_index is not None:
        from services.gateway.workers import reuseport_socket

        sock = reuseport_socket(settings.host, settings.port)
    await serve_app(create_app(settings), settings, sock)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return service_main("gateway", GatewaySettings, run, argv=argv, settings_cls=GatewaySettings,
                        description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
