"""A rollout's sandbox: its workspace on the host, and the bubblewrap backend that runs commands in it.

Why: a harness is someone else's code talking to our relay; it must see its instruction, write its answer,
reach the relay and nothing else, and never outlive its budget. Per command, bwrap gives new mount, PID,
network, IPC, UTS (and user, where the kernel allows) namespaces: the host's ``/usr`` and ``/etc`` and the
interpreter's prefix read-only, ``/app``, ``/logs``, ``/root`` and ``/tmp`` writable and private to the
rollout, ``/tests`` bound only for the verifier, the relay only through a bound unix socket (the harness
phase), no other network (only loopback exists). stdin is closed; the command runs in its own session and
process group, which is killed (SIGKILL) at its timeout; ``--die-with-parent`` and the PID namespace take
every process inside down with it; every capability is dropped. What it does not isolate: see docs/rollouts.md (same kernel, no seccomp
filter, no cgroup CPU/memory accounting beyond rlimits, root stays uid 0 unless the user namespace maps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from schemas.rollout import CommandRun
from services.rollouts.settings import BwrapSandbox, HarnessSettings

Phase = Literal["harness", "verifier"]
INIT = Path(__file__).resolve().parent / "sandbox_init.py"
SOCKET_IN_SANDBOX = "/run/fanroute/relay.sock"
INIT_IN_SANDBOX = "/opt/fanroute/sandbox_init.py"


@dataclass(frozen=True)
class Workspace:
    """A rollout's directories on the host: ``app``, ``logs``, ``root`` (holds instruction.md), ``tests``
    (mounted only for the verifier), ``task`` (the task's other files) and ``run`` (the relay socket)."""

    root: Path

    @property
    def app(self) -> Path:
        return self.root / "app"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def home(self) -> Path:
        return self.root / "root"

    @property
    def tests(self) -> Path:
        return self.root / "tests"

    @property
    def task(self) -> Path:
        return self.root / "task"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "relay.sock"

    @classmethod
    def create(cls, files: Mapping[str, str], base: Path | None = None) -> Workspace:
        """Lay out a fresh workspace from a task's files (``tests/`` apart, ``instruction.md`` in /root)."""
        ws = cls(Path(tempfile.mkdtemp(prefix="fanroute-rollout-", dir=base)))
        for d in (ws.app, ws.logs / "agent", ws.logs / "verifier", ws.home, ws.tests, ws.task, ws.socket.parent):
            d.mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            path = PurePosixPath(rel)
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise ValueError(f"task file {rel!r} escapes the task directory")
            top = ws.tests.parent if path.parts[0] == "tests" else ws.task
            target = top.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        instruction = ws.task / "instruction.md"
        if instruction.exists():
            shutil.copyfile(instruction, ws.home / "instruction.md")
        for d in (ws.app, ws.logs, ws.logs / "agent", ws.logs / "verifier", ws.home):
            d.chmod(0o777)  # writable whatever uid the sandbox maps to
        return ws

    def answer(self, name: str = "answer.txt", limit: int = 65_536) -> str | None:
        """What the harness left in ``/app/<name>`` (at most ``limit`` bytes), or None."""
        try:
            with (self.app / name).open("rb") as handle:
                return handle.read(limit).decode("utf-8", "replace")
        except OSError:
            return None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Sandbox(Protocol):
    """A backend: where the relay is, from inside; run one command of one phase in a workspace."""

    kind: Literal["bwrap", "docker"]
    relay_base_url: str

    async def prepare(self, ws: Workspace) -> None: ...

    async def run(self, ws: Workspace, phase: Phase, argv: tuple[str, ...], env: Mapping[str, str],
                  timeout_s: float, limit: int) -> CommandRun: ...

    async def close(self, ws: Workspace) -> None: ...


async def _drain(stream: asyncio.StreamReader | None, limit: int) -> tuple[bytes, bool]:
    """Read ``stream`` to EOF, keeping the first ``limit`` bytes; (kept, whether anything was dropped)."""
    kept, dropped = bytearray(), False
    if stream is None:
        return b"", False
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        kept += chunk[:max(room, 0)]
        dropped = dropped or len(chunk) > room
    return bytes(kept), dropped


async def run_process(argv: list[str], shown: tuple[str, ...], timeout_s: float, limit: int,
                      preexec: object = None) -> CommandRun:
    """Run ``argv`` with stdin closed in its own session; at ``timeout_s`` SIGKILL its process group."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, preexec_fn=preexec)  # type: ignore[arg-type]
    out_task = asyncio.ensure_future(_drain(proc.stdout, limit))
    err_task = asyncio.ensure_future(_drain(proc.stderr, limit))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    try:
        (out, cut_out), (err, cut_err) = await asyncio.wait_for(asyncio.gather(out_task, err_task), 5)
    except TimeoutError:  # something left the group and holds the pipes open
        out_task.cancel()
        err_task.cancel()
        (out, cut_out), (err, cut_err) = (b"", True), (b"", True)
    return CommandRun(command=shown, exit_code=None if timed_out else proc.returncode, timed_out=timed_out,
                      timeout_s=timeout_s, duration_s=round(time.monotonic() - started, 3),
                      stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                      truncated=cut_out or cut_err)


def _rlimits(memory_mb: int, file_size_mb: int) -> Callable[[], None]:
    """The preexec_fn that sets the sandbox's rlimits (inherited by bwrap and everything inside)."""
    def apply() -> None:
        if memory_mb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        if file_size_mb:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_mb << 20, file_size_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


class Bubblewrap:
    """The ``bwrap`` backend (see the module docstring)."""

    kind: Literal["bwrap"] = "bwrap"

    def __init__(self, settings: BwrapSandbox, harness: HarnessSettings) -> None:
        self.settings, self.harness = settings, harness
        self.relay_base_url = f"http://127.0.0.1:{settings.relay_port}"
        prefixes = [settings.python_prefix] if settings.python_prefix else [Path(sys.base_prefix), Path(sys.prefix)]
        self.prefixes = tuple(dict.fromkeys(p.resolve() for p in prefixes))
        self.python = str(self.prefixes[-1] / "bin" / "python3")

    def check(self) -> None:
        """Refuse to start where bwrap is missing (``apt-get install bubblewrap``)."""
        if shutil.which(self.settings.bwrap) is None:
            from services.common.errors import ConfigError

            raise ConfigError(f"sandbox type bwrap: {self.settings.bwrap!r} not found (apt-get install bubblewrap)")

    def path_env(self) -> str:
        return ":".join([*(str(p / "bin") for p in reversed(self.prefixes)), "/usr/local/bin", "/usr/bin", "/bin"])

    def argv(self, ws: Workspace, phase: Phase, command: tuple[str, ...], env: Mapping[str, str]) -> list[str]:
        """The bwrap command line of one command of ``phase``."""
        s = self.settings
        # --cap-drop ALL: run as root, bwrap would otherwise leave the child every capability in its user namespace
        args = [s.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "sandbox"]
        for path in (*s.system_ro_binds, *s.extra_ro_binds):
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        for link in ("bin", "lib", "lib64", "sbin"):
            host = Path("/") / link
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{link}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{link}"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                 "--bind", str(ws.home), "/root", "--bind", str(ws.app), "/app", "--bind", str(ws.logs), "/logs"]
        for prefix in self.prefixes:  # after /root: a prefix under /root (pyenv) is bound over the private home
            args += ["--ro-bind", str(prefix), str(prefix)]
        if phase == "harness":
            args += ["--ro-bind", str(self.harness.directory), "/harness", "--ro-bind", str(INIT), INIT_IN_SANDBOX,
                     "--ro-bind", str(ws.socket), SOCKET_IN_SANDBOX, "--chdir", "/app"]
            command = (self.python, INIT_IN_SANDBOX, str(s.relay_port), SOCKET_IN_SANDBOX, "--", *command)
        else:
            args += ["--ro-bind", str(ws.tests), "/tests", "--chdir", "/root"]
        args += ["--clearenv"]
        for key, value in {"PATH": self.path_env(), "HOME": "/root", "LANG": "C.UTF-8", **env}.items():
            args += ["--setenv", key, value]
        return [*args, "--", *command]

    async def prepare(self, ws: Workspace) -> None:
        return None

    async def run(self, ws: Workspace, phase: Phase, argv: tuple[str, ...], env: Mapping[str, str],
                  timeout_s: float, limit: int) -> CommandRun:
        return await run_process(self.argv(ws, phase, argv, env), argv, timeout_s, limit,
                                 _rlimits(self.settings.memory_mb, self.settings.file_size_mb))

    async def close(self, ws: Workspace) -> None:
        return None


def make_sandbox(settings: object, harness: HarnessSettings) -> Sandbox:
    """The configured backend (``docker`` imports the docker SDK only when chosen)."""
    if isinstance(settings, BwrapSandbox):
        box = Bubblewrap(settings, harness)
        box.check()
        return box
    from services.rollouts.docker_sandbox import Docker

    docker = Docker(settings, harness)  # type: ignore[arg-type]
    docker.check()
    return docker
