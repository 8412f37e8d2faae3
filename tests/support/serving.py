"""Serving an app for a test on loopback, and free ports.

- :func:`free_port` and :func:`served` (``async with served(app, port, what=...) as url``: uvicorn as a
  task of the test's event loop, entered once the app's lifespan has started, stopped at the block's
  end) are the demo's own helpers from :mod:`services.tools.serving`, re-exported here;
- :class:`LoopbackServer` runs an app in a background thread (for fakes that synchronous code or
  another process calls) on a socket bound before uvicorn starts, so connections simply queue until
  uvicorn accepts them: no start-up wait.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from services.tools.serving import free_port, served

__all__ = ["LoopbackServer", "free_port", "loopback_socket", "served"]


def loopback_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1:<free port> (``getsockname()[1]`` is the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class LoopbackServer:
    """An ASGI app served by uvicorn in a background thread on 127.0.0.1:<free port>; ``with`` it, or
    :meth:`start` and :meth:`stop` it."""

    def __init__(self, app: Any, name: str = "fake-http") -> None:
        import uvicorn

        self._sock = loopback_socket()
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=name, daemon=True)

    def url(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
