"""The ``docker`` backend: the task's ``environment/Dockerfile`` built with the docker SDK, one container per
rollout; the harness and then the verifier run in it (``docker exec``), ``/tests`` copied in only for the
verifier. UNTESTED: no Docker daemon answers on the machines this was written on; bwrap is the tested path.

Why keep it: where a daemon exists it gives the isolation the task asks for (its own image, a container
network that should reach the relay only - configure ``network`` accordingly; this module does not add
firewall rules).
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Mapping
from typing import Any, Literal

from schemas.base import content_id
from schemas.rollout import CommandRun
from services.rollouts.sandbox import Phase, Workspace
from services.rollouts.settings import DockerSandbox, HarnessSettings


def _tar(directory: Any, arcname: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(directory), arcname=arcname)
    return buf.getvalue()


class Docker:
    """One container per workspace, built from the task's environment (cached by the Dockerfile's hash)."""

    kind: Literal["docker"] = "docker"

    def __init__(self, settings: DockerSandbox, harness: HarnessSettings) -> None:
        import docker

        self.settings, self.harness = settings, harness
        self.client = docker.DockerClient(base_url=settings.base_url) if settings.base_url else docker.from_env()
        self.relay_base_url = settings.relay_url_for_containers
        self.containers: dict[str, Any] = {}

    def _image(self, ws: Workspace) -> str:
        if self.harness.image:
            return self.harness.image
        env = ws.task / "environment"
        tag = f"fanroute-task:{content_id((env / 'Dockerfile').read_text(encoding='utf-8'), length=16)}"
        self.client.images.build(path=str(env), tag=tag, rm=True)
        return tag

    def _start(self, ws: Workspace) -> None:
        image = self._image(ws)
        container = self.client.containers.run(
            image, command=["sleep", "infinity"], detach=True, network=self.settings.network,
            mem_limit=f"{self.settings.memory_mb}m", working_dir="/app", stdin_open=False,
            volumes={str(self.harness.directory): {"bind": "/harness", "mode": "ro"}},
            extra_hosts={"host.docker.internal": "host-gateway"})
        container.exec_run(["mkdir", "-p", "/root", "/logs/agent", "/logs/verifier", "/app"])
        container.put_archive("/root", _tar(ws.home / "instruction.md", "instruction.md"))
        self.containers[str(ws.root)] = container

    async def prepare(self, ws: Workspace) -> None:
        await asyncio.to_thread(self._start, ws)

    def _exec(self, ws: Workspace, phase: Phase, argv: tuple[str, ...], env: Mapping[str, str],
              timeout_s: float, limit: int) -> CommandRun:
        container = self.containers[str(ws.root)]
        if phase == "verifier":
            container.put_archive("/", _tar(ws.tests, "tests"))
        started = time.monotonic()
        wrapped = ["timeout", "-s", "KILL", f"{timeout_s:g}", *argv]
        result = container.exec_run(wrapped, environment=dict(env), workdir="/app" if phase == "harness" else "/root",
                                    demux=True, stdin=False)
        out, err = result.output if isinstance(result.output, tuple) else (result.output, b"")
        out, err = out or b"", err or b""
        code = result.exit_code
        timed_out = code == 137 and time.monotonic() - started >= timeout_s - 0.5
        if phase == "harness":  # the answer and the agent logs back to the workspace, as bwrap leaves them
            bits, _ = container.get_archive("/app")
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                tar.extractall(ws.root, filter="data")
        else:
            bits, _ = container.get_archive("/logs/verifier")
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                tar.extractall(ws.logs, filter="data")
        return CommandRun(command=argv, exit_code=None if timed_out else code, timed_out=timed_out,
                          timeout_s=timeout_s, duration_s=round(time.monotonic() - started, 3),
                          stdout=out[:limit].decode("utf-8", "replace"), stderr=err[:limit].decode("utf-8", "replace"),
                          truncated=len(out) > limit or len(err) > limit)

    async def run(self, ws: Workspace, phase: Phase, argv: tuple[str, ...], env: Mapping[str, str],
                  timeout_s: float, limit: int) -> CommandRun:
        return await asyncio.to_thread(self._exec, ws, phase, argv, env, timeout_s, limit)

    async def close(self, ws: Workspace) -> None:
        container = self.containers.pop(str(ws.root), None)
        if container is not None:
            await asyncio.to_thread(container.remove, force=True)
