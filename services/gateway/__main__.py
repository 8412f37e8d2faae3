"""``python -m services.gateway``: parse settings, then serve the gateway (``app.py``)."""

from __future__ import annotations

import sys

from services.common.entry import app_main
from services.gateway.settings import GatewaySettings


def main() -> int:
    return app_main("gateway", GatewaySettings, "services.gateway.app")


if __name__ == "__main__":
    sys.exit(main())
