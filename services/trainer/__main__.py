"""``python -m services.trainer``: the ``fanroute train`` command (services/trainer/cli.py)."""

from __future__ import annotations

import sys

from services.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
