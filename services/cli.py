"""The ``fanroute`` command: one entry point, one subcommand per job.

Long-running services are started by their own ``__main__`` (``fanroute gateway`` is
``python -m services.gateway``); every other command lives in its package's ``cli.py``, which
registers its subcommands (``add_parser``) and runs them (``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand → (module whose ``main()`` serves it, help).
SERVICES: dict[str, tuple[str, str]] = {
    "gateway": ("services.gateway.__main__", "serve the fan-out gateway (same as python -m services.gateway)"),
    "judge": ("services.judge.__main__", "run the judge worker (same as python -m services.judge)"),
    "episodes": ("services.episodes.__main__", "run the episode builder (same as python -m services.episodes)"),
    "publisher": ("services.publisher.__main__", "serve the adapter publisher (same as python -m services.publisher)"),
    "sampler": ("services.sampler.__main__", "serve the CPU sampler (same as python -m services.sampler)"),
    "relay": ("services.relay.__main__", "serve the token-in/token-out relay (same as python -m services.relay)"),
    "rollouts": ("services.rollouts.__main__", "run the rollout runner (same as python -m services.rollouts)"),
    "console": ("services.console.__main__", "serve the operator console (same as python -m services.console)"),
    "loop": ("services.loop.__main__", "the continual loop: a cycle per slot, early on drift; `loop demo` shows drift "
                                  "and recovery (same as python -m services.loop)"),
}
#: Packages whose ``cli.py`` registers commands, in help order.
COMMANDS = ("services.tools.cli", "services.judge.cli", "services.episodes.cli", "services.importer.cli",
            "services.publisher.cli", "services.relay.cli", "services.models.cli", "services.trainer.cli", "services.evaluate.cli",
            "services.common.cli")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The parser, and which module runs each subcommand."""
    p = argparse.ArgumentParser(prog="fanroute", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    owner = {}
    for name, (module, help_text) in SERVICES.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed here; main() hands its argv over
        owner[name] = module
    for module in COMMANDS:
        before = set(sub.choices)
        importlib.import_module(module).add_parser(sub)
        owner.update(dict.fromkeys(set(sub.choices) - before, module))
    return p, owner


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SERVICES:  # a service parses its own command line (--help, --show-settings)
        return importlib.import_module(SERVICES[argv[0]][0]).main(argv[1:], prog=f"fanroute {argv[0]}")
    parser, owner = _parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(owner[args.cmd])
    from services.common.logging import setup_logging

    setup_logging("WARNING")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
