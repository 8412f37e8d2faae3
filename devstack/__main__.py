"""``python -m devstack up|status|down|prepare``: parse the arguments, then run the command."""

from __future__ import annotations

import sys

from devstack.stack import main

if __name__ == "__main__":
    sys.exit(main())
