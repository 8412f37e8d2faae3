"""``python -m services.sampler``: parse settings, then load the base model once and serve."""

from __future__ import annotations

import sys

from services.common.entry import serve_app, service_main
from services.sampler.settings import SamplerSettings


async def run(settings: SamplerSettings) -> None:
    """Serve until interrupted (torch and the model load inside the app's lifespan)."""
    from services.sampler.app import create_app

    await serve_app(create_app(settings), settings)


def main() -> int:
    return service_main("sampler", SamplerSettings, run)


if __name__ == "__main__":
    sys.exit(main())
