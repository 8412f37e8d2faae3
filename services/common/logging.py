"""One logging set-up for every service: one line per event, UTC timestamps."""

from __future__ import annotations

import logging
import time


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once (safe to call again)."""
    fmt = logging.Formatter("%(asctime)sZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
    fmt.converter = time.gmtime
    root = logging.getLogger()
    if not any(getattr(h, "_fanroute", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(fmt)
        handler._fanroute = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiokafka", "httpx", "faststream"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
