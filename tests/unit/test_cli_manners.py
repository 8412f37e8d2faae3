"""Command-line manners: every entry point's ``--help`` prints usage and exits 0 without touching a
broker; an unknown flag exits 2 naming the flag."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services import cli
from services.common import paths
from services.tools.serving import free_port

#: ``python -m`` entry points (the long-running services, plus the commands with a ``__main__``).
MODULES = (*[m.removesuffix(".__main__") for m, _ in cli.SERVICES.values()], "services.trainer", "services.models")


REQUIRED = "the following arguments are required"


def _env() -> dict[str, str]:
    """A broker and Redis that are not there: an entry point that tried to connect would fail or hang."""
    dead = f"127.0.0.1:{free_port()}"
    return {**os.environ, "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": dead, "KAFKA_BOOTSTRAP_SERVERS": dead,
            "FANROUTE_REDIS__URL": f"redis://{dead}/0", "FANROUTE_ADMIN_TOKEN": "t"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=120,
                          cwd=paths.REPO_ROOT)


@pytest.mark.parametrize("module", MODULES)
def test_python_m_help_prints_usage_and_exits_0(module: str) -> None:
    proc = _run("-m", module, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout[:200]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("module", MODULES)
def test_python_m_unknown_flag_exits_2_naming_it(module: str) -> None:
    proc = _run("-m", module, "--no-such-flag")
    assert proc.returncode == 2 and ("--no-such-flag" in proc.stderr or REQUIRED in proc.stderr), proc.stderr


@pytest.mark.parametrize("service", sorted(cli.SERVICES))
def test_a_service_help_lists_its_environment(service: str, capsys) -> None:
    """``fanroute <service> --help`` is the service's own usage, every setting with its variable."""
    with pytest.raises(SystemExit) as exc:
        cli.main([service, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"usage: fanroute {service} ")
    assert "FANROUTE_LOG_LEVEL" in out and "FANROUTE_KAFKA__BOOTSTRAP_SERVERS" in out


def test_show_settings_prints_resolved_settings_with_secrets_masked(capsys, monkeypatch) -> None:
    import json

    monkeypatch.setenv("FANROUTE_ADMIN_TOKEN", "s3cret")
    assert cli.main(["relay", "--show-settings"]) == 0
    out = capsys.readouterr().out
    settings = json.loads(out)
    assert "s3cret" not in out and settings["tokenizer"] == str(paths.default_base_dir())


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every (sub)command path of the ``fanroute`` parser."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out.extend(_commands(sub, (*prefix, name)))
    return out


COMMANDS = [c for c in _commands(cli._parser()[0]) if c[0] not in cli.SERVICES]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_fanroute_command_has_help(command: tuple[str, ...], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*command, "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: fanroute ")


@pytest.mark.parametrize("command", [c for c in COMMANDS if len(c) == 1], ids=" ".join)
def test_every_fanroute_command_refuses_an_unknown_flag(command: tuple[str, ...], capsys) -> None:
    """Exit 2 naming the flag — or, where the command also lacks a required argument, naming that first
    (argparse checks required arguments before it reports unrecognized ones)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*command, "--no-such-flag"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and ("unrecognized arguments: --no-such-flag" in err or REQUIRED in err), err
