"""``fanroute train`` / ``python -m services.trainer``: parse the config first, then train (torch loads late)."""

from __future__ import annotations

import argparse
import sys

from services.trainer.settings import add_arguments, settings_from_args

DESCRIPTION = ("Fine-tune the student router with LoRA on the episode dataset: --kind sft trains on the "
               "recorded orderings, --kind opsd on the current adapter's own samples (drawn from the sampler "
               "at --sampler-url) pulled toward what it says given a hint. The dataset is read as of a time "
               "from the episodes topic, or from --episodes-file; --kind rl trains on the rollout runner's groups "
               "(rollouts topic) of the replay tasks in --tasks-dir, publishing every step; refuses judges without an open calibration "
               "gate unless --allow-uncalibrated; at most one pass. Every flag also reads from "
               "FANROUTE_<NAME> (nested with __, e.g. FANROUTE_LORA__R).")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train`` on a subparsers object (``fanroute train ...``)."""
    p = sub.add_parser("train", help="fine-tune the student router (LoRA; run kinds sft, opsd, rl)", description=DESCRIPTION)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fanroute train`` from parsed args.

    Exit 0 done; 2 invalid settings or refused data; 1 Kafka or the sampler unreachable, or publishing failed.
    """
    from pydantic import ValidationError

    from services.common.errors import BusError, FanrouteError
    from services.common.logging import setup_logging

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"fanroute train: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    from services.trainer.sampler_client import SamplerError
    from services.trainer.train import DivergedError, PublishError, train

    try:
        if settings.run.type == "opsd":
            from services.trainer.opsd import train_opsd

            train_opsd(settings)
        elif settings.run.type == "rl":
            from services.trainer.rl import train_rl

            train_rl(settings)
        else:
            train(settings)
    except (BusError, DivergedError, PublishError, SamplerError) as exc:
        print(f"fanroute train: {exc}", file=sys.stderr)
        return 1
    except FanrouteError as exc:
        print(f"fanroute train: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m services.trainer``."""
    parser = argparse.ArgumentParser(prog="python -m services.trainer", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
