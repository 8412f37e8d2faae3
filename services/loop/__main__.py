"""``python -m services.loop`` (``fanroute loop``): the continual loop's scheduler."""

from __future__ import annotations

import sys

from services.loop.cli import main

if __name__ == "__main__":
    sys.exit(main())
