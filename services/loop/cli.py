"""``fanroute loop``: flags over the ``FANROUTE_`` settings (a flag wins), then one cycle or the schedule;
``fanroute loop demo``: the time-compressed drift scenario on the local stack."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from datetime import UTC
from pathlib import Path

from services.common.entry import env_help
from services.common.files import instant

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``24h``, ``7d`` → seconds."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 15m, 24h, 7d)")
    return float(m[1]) * _UNIT[m[2]]


#: flag → settings field, for the flags that set one.
FIELDS = {"once": "once", "every": "every_s", "at": "at", "kind": "kind", "model_id": "model_id",
          "publisher_url": "publisher_url", "router_url": "router_url", "min_new_episodes": "min_new_episodes",
          "dataset_window": "dataset_window_s", "held_out_fraction": "held_out_fraction",
          "drift_threshold": "drift_threshold", "drift_check": "drift_check_s", "work_dir": "work_dir",
          "router_mode": "router_mode", "max_steps": "max_steps", "allow_uncalibrated": "allow_uncalibrated"}


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    from services.loop.settings import LoopSettings

    p = argparse.ArgumentParser(prog=prog or "fanroute loop", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="The continual loop: per cycle, the episodes topic as of the slot → "
                                            "train from the deployed router → evaluate on the held-out traces since "
                                            "the last cycle → promote if the rule says so; a cycle early when the "
                                            "fan-out slice drifts. `fanroute loop demo` shows it on a degraded "
                                            "provider.", epilog=env_help(LoopSettings))
    when = p.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", default=None,
                      help="run the current slot's cycle (finishing one left unfinished first) and exit")
    when.add_argument("--at", default=None, help="run daily at this UTC time, HH:MM (e.g. 02:00)")
    p.add_argument("--every", type=duration, default=None, help="cycle interval (e.g. 24h, 30m); slots align to it")
    p.add_argument("--slot", type=instant, default=None, help="with --once: the slot to run or re-run (ISO time)")
    p.add_argument("--kind", choices=("lm", "linear"), default=None, help="the router a cycle trains")
    p.add_argument("--model-id", default=None, help="the model id cycles publish and promote under")
    p.add_argument("--publisher-url", default=None, help="the adapter publisher")
    p.add_argument("--router-url", default=None, help="where LM candidates are asked during the evaluation")
    p.add_argument("--router-mode", default=None, help="how an LM router is asked (score, first-token, generate)")
    p.add_argument("--min-new-episodes", type=int, default=None, help="fewer new episodes than this: skipped")
    p.add_argument("--dataset-window", type=duration, default=None,
                   help="train on the episodes of this long before the slot (default: all)")
    p.add_argument("--held-out-fraction", type=float, default=None, help="dev queries held out of training")
    p.add_argument("--drift-threshold", type=float, default=None, help="drift score that calls a cycle early")
    p.add_argument("--drift-check", type=duration, default=None, help="how often drift is checked between slots")
    p.add_argument("--max-steps", type=int, default=None, help="LM SFT: most optimizer steps per cycle")
    p.add_argument("--allow-uncalibrated", action="store_true", default=None,
                   help="train even when the judge's calibration gate is closed")
    p.add_argument("--work-dir", type=Path, default=None, help="per-cycle datasets, adapters and evaluations")
    p.add_argument("--show-settings", action="store_true", help="print the resolved settings as JSON and exit")
    return p


def settings_from(args: argparse.Namespace):
    """The settings with the flags given laid over the environment (ValidationError names the field)."""
    from services.loop.settings import LoopSettings

    given = {field: getattr(args, flag) for flag, field in FIELDS.items() if getattr(args, flag) is not None}
    return LoopSettings(**given)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, check, run; bad flags or settings are one line naming the field and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        from services.loop.demo import main as demo_main

        return demo_main(argv[1:], prog=f"{prog or 'fanroute loop'} demo")
    args = parser(prog).parse_args(argv)
    from pydantic import ValidationError

    from services.common.errors import ConfigError
    from services.common.logging import setup_logging

    try:
        settings = settings_from(args)
        if args.slot is not None and not settings.once:
            raise ConfigError("slot: --slot names the cycle --once runs; it needs --once")
    except (ValidationError, ConfigError) as exc:
        print(f"fanroute loop: invalid settings: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.show_settings:
        print(json.dumps(settings.model_dump(mode="json"), indent=2, sort_keys=True))
        return 0
    setup_logging(settings.log_level)
    from services.loop.worker import run

    slot = args.slot.astimezone(UTC) if args.slot is not None else None
    return asyncio.run(run(settings, slot))


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors())
    return str(exc)
