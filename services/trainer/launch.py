"""Run a training in its own process: settings become the trainer's flags and environment, the child's
``summary.json`` the result.

Why: a composing command (the demo) that trains in its own process keeps the trainer's model,
optimiser state and allocator arenas resident after the run; a child gives every byte back when it
exits, so the judge's and the trainer's models are never resident in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from services.common.errors import FanrouteError
from services.common.settings import connection_env
from services.trainer.settings import _ENV_ONLY, TrainerSettings


class TrainerProcessError(FanrouteError, RuntimeError):
    """The training process exited non-zero (its exit code and the tail of its log say why)."""


def _flag_value(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _flags(model: BaseModel, defaults: BaseModel, prefix: str, skip: set[str]) -> list[str]:
    argv: list[str] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if name in skip or value == getattr(defaults, name):
            continue
        flag = "--" + prefix + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + prefix + name.replace("_", "-"))
        elif value is None:
            raise ValueError(f"{name}: a None over a non-None default has no flag")
        else:
            argv += [flag, _flag_value(value)]
    return argv


def to_argv(settings: TrainerSettings) -> list[str]:
    """The ``fanroute train`` flags that rebuild ``settings`` (Kafka and Redis go by environment)."""
    plain = TrainerSettings.model_construct()  # field defaults, not this process's environment
    argv = _flags(settings, plain, "", {"run", "lora", *_ENV_ONLY})
    run_defaults = type(settings.run).model_construct()
    argv += ["--kind", settings.run.type, *_flags(settings.run, run_defaults, "", {"type"})]
    argv += _flags(settings.lora, type(settings.lora).model_construct(), "lora-", set())
    return argv


def train_in_process(settings: TrainerSettings, log_file: Path | None = None) -> dict[str, Any]:
    """``python -m services.trainer`` with ``settings``; its progress lines on this process's stdout, its
    log records in ``log_file`` (default ``<output_dir>/trainer.log``); returns its ``summary.json``."""
    log_file = log_file or settings.output_dir / "trainer.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **connection_env(settings), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "services.trainer", *to_argv(settings)]
    with log_file.open("ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1) as child:
            assert child.stdout is not None
            for line in child.stdout:  # its progress lines, as they come
                print(line.rstrip("\n"), flush=True)
        code = child.returncode
    if code != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        raise TrainerProcessError(f"the trainer exited {code}: {' | '.join(tail)} (log: {log_file})")
    return json.loads((settings.output_dir / "summary.json").read_text())
