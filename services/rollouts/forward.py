"""Host side of a sandbox's only way out: a unix socket whose connections are piped to the relay's TCP port.

Why: the sandbox has no network; the socket file is bound into it (and ``sandbox_init`` turns it back into
a loopback TCP port), so the harness reaches the relay and nothing else. It counts connections, so a
rollout record can say whether the harness ever dialled out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class RelayForward:
    """``async with RelayForward(path, relay_url)``: serve ``path`` until the block ends."""

    def __init__(self, path: Path, relay_url: str) -> None:
        parts = urlsplit(relay_url)
        self.path, self.host, self.port = path, parts.hostname or "127.0.0.1", parts.port or 80
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            log.warning("relay forward: cannot reach %s:%s: %s", self.host, self.port, exc)
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_unix_server(self._spawn, path=str(self.path))
        self.path.chmod(0o666)  # the sandbox may run as another uid
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
