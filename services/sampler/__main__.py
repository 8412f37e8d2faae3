"""``python -m services.sampler``: parse settings, then load the base model once and serve (``app.py``)."""

from __future__ import annotations

import sys

from services.common.entry import app_main
from services.sampler.settings import SamplerSettings


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return app_main("sampler", SamplerSettings, "services.sampler.app", argv=argv, description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
