"""``python -m services.relay``: parse settings, then load the policy's tokenizer and serve (``app.py``)."""

from __future__ import annotations

import sys

from services.common.entry import app_main
from services.relay.settings import RelaySettings


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return app_main("relay", RelaySettings, "services.relay.app", argv=argv, description=__doc__, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
