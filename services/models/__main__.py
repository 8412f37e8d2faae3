"""``python -m services.models prepare``: cache the embedded base model as safetensors."""

from __future__ import annotations

import sys

from services.models.cli import main

if __name__ == "__main__":
    sys.exit(main())
