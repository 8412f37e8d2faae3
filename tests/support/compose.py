"""The whole compose stack for a test: ``docker compose up --build --wait`` under a project of its own, on
free host ports, with the offline stand-in images (docker/local.env), torn down with ``down -v``.

The engine is started the way the Kafka broker is for other tests (``scripts/docker.sh start``); a machine
where it cannot start fails the test with the reason, it never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.tools.serving import free_port
from tests.support.docker_engine import DOCKER_SH, REPO

LOCAL_ENV = REPO / "docker" / "local.env"


def _run(argv: list[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 1800) -> str:
    res = subprocess.run(argv, cwd=REPO, env=None if env is None else {**os.environ, **env}, text=True,
                         capture_output=True, timeout=timeout_s, check=False)
    if res.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` exited {res.returncode}:\n{res.stderr[-4000:]}{res.stdout[-2000:]}")
    return res.stdout


def ensure_engine() -> None:
    """A Docker engine and Compose v2 answer, and the offline stand-in images exist (built if not)."""
    for step in ("install", "start", "images"):
        _run(["bash", str(DOCKER_SH), step])


@dataclass
class Stack:
    """A running compose project: its name, the variables it was started with, host ports, timings."""

    project: str
    env: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)

    def port(self, name: str) -> int:
        return int(self.env[f"FANROUTE_{name.upper()}_HOST_PORT"])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name)}"

    @property
    def kafka_bootstrap(self) -> str:
        return f"localhost:{self.port('kafka')}"

    def compose(self, *args: str, timeout_s: float = 1800) -> str:
        return _run(["docker", "compose", "-p", self.project, "--env-file", str(LOCAL_ENV), *args],
                    env=self.env, timeout_s=timeout_s)

    def logs(self, tail: int = 60) -> str:
        res = subprocess.run(["docker", "compose", "-p", self.project, "--env-file", str(LOCAL_ENV), "logs",
                              "--no-color", "--tail", str(tail)], cwd=REPO, env={**os.environ, **self.env},
                             text=True, capture_output=True, check=False)
        return res.stdout + res.stderr

    def image_sizes(self) -> dict[str, int]:
        """Bytes of each image the stack runs (``docker image inspect``)."""
        names = [self.env[k] for k in ("FANROUTE_IMAGE", "FANROUTE_KAFKA_IMAGE", "FANROUTE_REDIS_IMAGE",
                                       "FANROUTE_PYTHON_IMAGE")]
        out = _run(["docker", "image", "inspect", "--format", "{{json .RepoTags}} {{.Size}}", *names])
        sizes = {}
        for line in out.splitlines():
            tags, size = line.rsplit(" ", 1)
            sizes[json.loads(tags)[0]] = int(size)
        return sizes


def local_env() -> dict[str, str]:
    """docker/local.env as a dict (the stand-in image names)."""
    pairs = (line.split("=", 1) for line in LOCAL_ENV.read_text().splitlines() if line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


@contextmanager
def compose_stack(models_dir: Path, model_name: str, work_dir: Path, **overrides: str) -> Iterator[Stack]:
    """``up --build --wait`` a fresh project; ``down -v`` at the end (its logs printed when the block failed)."""
    ensure_engine()
    work_dir.mkdir(parents=True, exist_ok=True)
    env = {**local_env(), "FANROUTE_IMAGE": "fanroute:dev", "FANROUTE_MODELS_DIR": str(models_dir),
           "FANROUTE_BASE_MODEL_NAME": model_name, "FANROUTE_ROLLOUT_WORK_DIR": str(work_dir), **overrides}
    for name in ("gateway", "publisher", "relay", "kafka", "redis"):
        env.setdefault(f"FANROUTE_{name.upper()}_HOST_PORT", str(free_port()))
    stack = Stack(project=f"fanroute-t{uuid.uuid4().hex[:8]}", env=env)
    started = time.monotonic()
    stack.compose("build")
    stack.timings["build_s"] = round(time.monotonic() - started, 1)
    up = time.monotonic()
    ok = False
    try:
        stack.compose("up", "-d", "--wait", "--wait-timeout", "900")
        stack.timings["up_s"] = round(time.monotonic() - up, 1)
        yield stack
        ok = True
    finally:
        if not ok:
            print(f"--- docker compose logs ({stack.project}) ---\n{stack.logs()}")
        down = time.monotonic()
        stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
        stack.timings["down_s"] = round(time.monotonic() - down, 1)
