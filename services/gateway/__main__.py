"""``python -m services.gateway``: parse settings, then serve the gateway (``app.py``)."""

from __future__ import annotations

import sys

from services.common.entry import app_main
from services.gateway.settings import GatewaySettings


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return app_main("gateway", GatewaySettings, "services.gateway.app", argv=argv, description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
