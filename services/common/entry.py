"""How every service process starts: command line and settings first (``--help`` prints usage and
touches nothing; a bad setting is a message and exit 2), then logging, then ``asyncio.run`` of its
``run``; HTTP services serve their app with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from services.common.logging import setup_logging

S = TypeVar("S")
ENV_PREFIX = "FANROUTE_"


def env_help(settings_cls: type | None) -> str:
    """One line per environment variable of ``settings_cls`` (nested models with ``__``), with its
    description and default: what ``--help`` shows, since services are configured by environment."""
    if settings_cls is None:
        return ""
    from pydantic import BaseModel

    lines: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, field in cls.model_fields.items():
            ann = field.annotation
            var = f"{prefix}{name.upper()}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, var + "__")
                continue
            default = "computed" if field.default_factory is not None else repr(field.default)
            default = default if len(default) <= 80 else default[:77] + "..."
            lines.append(f"  {var}\n      {field.description or ''} (default: {default})")

    walk(settings_cls, ENV_PREFIX)
    return "configuration (environment variables):\n" + "\n".join(lines)


def service_parser(name: str, description: str | None, settings_cls: type | None = None,
                   prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m services.<name>``: no flags but ``--help`` and ``--show-settings``,
    every setting listed in the epilog (an unknown flag exits 2 naming it)."""
    p = argparse.ArgumentParser(prog=prog or f"python -m services.{name}", description=description,
                                epilog=env_help(settings_cls), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--show-settings", action="store_true",
                   help="print the settings this environment resolves to (secrets masked) as JSON and exit")
    return p


def service_main(name: str, load: Callable[[], S], run: Callable[[S], Awaitable[None]], *,
                 refusal: str = "invalid settings", argv: Sequence[str] | None = None,
                 settings_cls: type | None = None, description: str | None = None, prog: str | None = None) -> int:
    """Parse ``argv``, ``load()`` the settings (and any start-up checks), then run; 2 with the reason
    if refused. ``--help`` exits 0 before anything is loaded or connected."""
    from pydantic import ValidationError

    from services.common.errors import ConfigError

    args = service_parser(name, description, settings_cls or (load if isinstance(load, type) else None),
                          prog).parse_args(argv)
    try:
        settings = load()
    except (ValidationError, ConfigError) as exc:
        print(f"fanroute {name}: {refusal}: {exc}", file=sys.stderr)
        return 2
    if args.show_settings:
        print(json.dumps(settings.model_dump(mode="json"), indent=2, sort_keys=True))  # type: ignore[attr-defined]
        return 0
    setup_logging(settings.log_level)  # type: ignore[attr-defined]
    before = gc.get_threshold()
    tune_gc(getattr(settings, "gc", None))
    try:
        with asyncio.Runner(loop_factory=loop_factory(getattr(settings, "event_loop", "asyncio"))) as runner:
            runner.run(run(settings))
    finally:
        gc.set_threshold(*before)  # a caller in the same process (a test, a composing command) gets its own back
    return 0


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for ``uvloop`` (and ``auto`` where it is installed); None, the standard loop, otherwise.

    ``bench/gateway_overhead.py`` measures both: on its request path uvloop saved no CPU (its timers
    and task switches are not where the gateway's time goes), hence the standard loop by default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("FANROUTE_EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def tune_gc(gc_settings: Any) -> None:
    """Set the collector's thresholds from ``FANROUTE_GC__*`` (nothing for settings without them)."""
    if gc_settings is not None:
        gc.set_threshold(gc_settings.young, gc_settings.middle, gc_settings.old)


def freeze_setup(gc_settings: Any) -> None:
    """Collect once, then move every object that exists now out of the collector's reach.

    Called once the app is built: what a service sets up lives as long as it does, and a full
    collection would otherwise walk it every time."""
    if gc_settings is not None and gc_settings.freeze:
        gc.collect()
        gc.freeze()


async def serve_app(app: Any, settings: Any, sock: Any = None) -> None:
    """Serve a FastAPI app on ``settings.host:port`` (or on the bound ``sock``) until interrupted."""
    import uvicorn

    freeze_setup(getattr(settings, "gc", None))
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock] if sock is not None else None)


def app_main(name: str, load: Callable[[], Any], app_module: str, *, argv: Sequence[str] | None = None,
             description: str | None = None, prog: str | None = None) -> int:
    """:func:`service_main` for an HTTP service: serve ``<app_module>.create_app(settings)``, the app
    (and whatever heavy module it needs) imported only after the settings parsed."""

    async def run(settings: Any) -> None:
        await serve_app(importlib.import_module(app_module).create_app(settings), settings)

    return service_main(name, load, run, argv=argv, description=description, prog=prog)
