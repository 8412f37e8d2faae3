"""Run a FastAPI app in this process (uvicorn) for as long as a ``with`` block: the demo's services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from services.common.errors import FanrouteError

log = logging.getLogger(__name__)


class StartupFailed(FanrouteError, RuntimeError):
    """An embedded app's lifespan failed: the message carries the app's own error (type and text)."""


class _StartupErrors(logging.Handler):
    """Keeps the exception uvicorn logs when an app's lifespan start-up raises."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.exc: BaseException | None = None

        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None and self.exc is None:
            self.exc = record.exc_info[1]
        message = record.getMessage()
        if message.startswith("Traceback") and not self.text:  # Starlette hands uvicorn the formatted traceback
            lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
            self.text = lines[-1] if lines else ""

    def reason(self) -> str:
        if self.exc is not None:
            text = str(self.exc).strip()
            return f"{type(self.exc).__name__}: {text.splitlines()[0] if text else ''}"
        return self.text


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

    # log_config=None: uvicorn's records go to the process's handlers (the demo's log file), not its own stderr
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, log_config=None))
    server.capture_signals = contextlib.nullcontext  # the process's own handlers stay in force
    errors = _StartupErrors()
    logging.getLogger("uvicorn.error").addHandler(errors)

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn's sys.exit on a failed start-up would stop the whole event loop
            raise StartupFailed(f"{what} did not start: {errors.reason() or f'its server exited ({exc.code})'}") \
                from None

    task = asyncio.create_task(serve(), name=f"serve:{what}")
    try:
        try:
            async with asyncio.timeout(start_timeout_s):
                while not server.started:
                    if task.done():
                        task.result()
                        raise StartupFailed(f"{what} did not start: {errors.reason() or 'its server exited'}")
                    await asyncio.sleep(0.05)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await task
        except (SystemExit, Exception) as exc:  # a start-up failure was raised above; do not mask it
            log.debug("%s stopped with %r", what, exc)
