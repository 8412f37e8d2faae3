"""How every service process starts: settings first (a bad one is a message and exit 2), then
logging, then ``asyncio.run`` of its ``run``; HTTP services serve their app with uvicorn."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common.logging import setup_logging

S = TypeVar("S")


def service_main(name: str, load: Callable[[], S], run: Callable[[S], Awaitable[None]], *,
                 refusal: str = "invalid settings") -> int:
    """``load()`` the settings (and any start-up checks), then run; 2 with the reason if refused."""
    from pydantic import ValidationError

    from services.common.errors import ConfigError

    try:
        settings = load()
    except (ValidationError, ConfigError) as exc:
        print(f"fanroute {name}: {refusal}: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)  # type: ignore[attr-defined]
    asyncio.run(run(settings))
    return 0


async def serve_app(app: Any, settings: Any) -> None:
    """Serve a FastAPI app on ``settings.host:port`` until interrupted."""
    import uvicorn

    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve()


def app_main(name: str, load: Callable[[], Any], app_module: str) -> int:
    """:func:`service_main` for an HTTP service: serve ``<app_module>.create_app(settings)``, the app
    (and whatever heavy module it needs) imported only after the settings parsed."""

    async def run(settings: Any) -> None:
        await serve_app(importlib.import_module(app_module).create_app(settings), settings)

    return service_main(name, load, run)
