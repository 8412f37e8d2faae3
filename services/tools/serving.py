"""Run a FastAPI app in this process (uvicorn) for as long as a ``with`` block: the demo's services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nothing listens on right now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def served(app: Any, port: int, *, what: str, start_timeout_s: float = 900.0) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1:``port``; yields its base URL once the lifespan has started.

    uvicorn reports a failed start-up by ending its task (SystemExit inside it), so the wait
    checks the task as well as ``server.started``. The server does not take over SIGINT/SIGTERM: an
    embedded uvicorn would turn them into "stop this one server" and the demo would carry on without it.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    server.capture_signals = contextlib.nullcontext  # the process's own handlers stay in force
    task = asyncio.create_task(server.serve(), name=f"serve:{what}")
    try:
        async with asyncio.timeout(start_timeout_s):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError(f"{what} exited during start-up")
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await task
        except (SystemExit, Exception) as exc:  # a start-up failure was raised above; do not mask it
            log.debug("%s stopped with %r", what, exc)
