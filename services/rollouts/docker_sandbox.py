"""The ``docker`` backend: one container per rollout, built from the task's ``environment/Dockerfile``; the
harness and then the verifier run in it (``docker exec``), ``/tests`` copied in only for the verifier.

Why: where a daemon answers it runs the harness in the task's own image, with cgroup limits bwrap lacks.
The image: the Dockerfile's ``FROM`` lines rewritten by ``base_images`` (official images cannot be pulled
everywhere), ``harness_layer`` appended, built from an in-memory context and tagged ``fanroute-task:<hash of
the rewritten context>``, so a task's image is built once per daemon; nothing is pulled at build time.

Isolation: ``network_mode=none`` (only the container's loopback); the relay only through the workspace's unix
socket, whose directory is bound read-only at ``/run/fanroute`` and turned back into ``127.0.0.1:relay_port``
by ``sandbox_init.py`` exactly as bwrap's argv does; every capability dropped, ``no-new-privileges``, the
engine's default seccomp profile, a read-only root file system with a tmpfs ``/tmp``; memory with swap
(``memory_mb``), processes and threads (``pids_limit``) and CPU (``cpus``) bounded by the container's
cgroup. ``/app``, ``/logs``, ``/root``, ``/harness``, ``/tests`` and ``/opt/fanroute`` are anonymous volumes
of the container (``/app`` and ``/root`` start with the image's content), removed with it. The harness's
files, ``sandbox_init.py`` and the instruction go in with ``put_archive``, the tests just before the
verifier, after every process the harness left behind is killed and ``/tests``, ``/logs/verifier`` and
``/tmp`` are emptied; ``/app`` and ``/logs/<phase>`` come back out with ``get_archive`` after each command
(also from a killed container), links and anything over ``copy_out_mb`` left behind.

Timeouts: at a command's ``timeout_s`` the runner kills the container itself (not an in-container
``timeout``): the run says ``timed_out``, and what the command printed and left in ``/app`` and ``/logs`` so
far is kept. A command killed by the memory limit exits 137 and says so on its stderr (the container's OOM
count). ``close`` removes the container with its volumes (force; idempotent, also after a kill).

Docker-out-of-Docker (compose): the runner talks to the host's daemon, so the only thing it binds into a
sandbox is the workspace's ``run/`` directory, which must be a host path: ``work_dir`` must be the same path
on the host and in the runner's container (bind it at the same place). Nothing else of the runner's own file
system is bound; the harness and the tests are copied in.

What it does not isolate: the host's kernel (a kernel exploit escapes), the volumes' disk use (no quota), and
the harness runs as root in the container (without capabilities).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import io
import logging
import re
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar

from schemas.base import content_id
from schemas.rollout import CommandRun
from services.common.errors import ConfigError, SandboxError
from services.rollouts.sandbox import INIT, INIT_IN_SANDBOX, SOCKET_IN_SANDBOX, Phase, Workspace
from services.rollouts.settings import DockerSandbox, HarnessSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
LABEL = "fanroute.sandbox"
VOLUMES = ("/app", "/logs", "/root", "/harness", "/tests", "/opt/fanroute")
_FROM = re.compile(r"^(\s*FROM\s+(?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_OOM = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)
_OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")  # cgroup v1, v2
# Run in the container before the verifier: kill what the harness left running (kill(-1) spares PID 1 and
# the caller), then empty what the verifier reads or writes, so nothing the harness planted there is used.
_BEFORE_VERIFIER = """\
import os, shutil
try:
    os.kill(-1, 9)
except ProcessLookupError:
    pass
for top in ("/tests", "/logs/verifier", "/tmp"):
    os.makedirs(top, exist_ok=True)
    for name in os.listdir(top):
        path = os.path.join(top, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
"""


def rewrite_from(dockerfile: str, base_images: Mapping[str, str]) -> str:
    """``dockerfile`` with each ``FROM <image>`` named in ``base_images`` replaced by its substitute."""
    def line(text: str) -> str:
        body = text.rstrip("\r\n")
        m = _FROM.match(body)
        if m is None or m.group(2) not in base_images:
            return text
        return f"{m.group(1)}{base_images[m.group(2)]}{m.group(3)}{text[len(body):]}"
    return "".join(line(ln) for ln in dockerfile.splitlines(keepends=True))


def _tar(files: Mapping[str, bytes], dirs: tuple[str, ...] = ()) -> bytes:
    """A tar of ``files`` (path → content; root-owned, mode 0644, mtime 0) and empty ``dirs`` (0777)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o777
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its relative POSIX path (``__pycache__`` left out)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def build_context(environment: Path, base_images: Mapping[str, str], layer: tuple[str, ...]) -> tuple[str, bytes]:
    """(tag, tar) of the task's build context: ``environment/`` with its Dockerfile rewritten (``base_images``)
    and ``layer`` appended; the tag hashes every file of the rewritten context."""
    dockerfile = environment / "Dockerfile"
    if not dockerfile.is_file():
        raise SandboxError("the task has no environment/Dockerfile to build its sandbox from")
    text = rewrite_from(dockerfile.read_text(encoding="utf-8"), base_images)
    if layer:
        text = text.rstrip("\n") + "\n" + "\n".join(layer) + "\n"
    files = _tree(environment) | {"Dockerfile": text.encode("utf-8")}
    digest = content_id(*[[name, hashlib.sha256(data).hexdigest()] for name, data in sorted(files.items())],
                        length=16)
    return f"fanroute-task:{digest}", _tar(files)


@contextlib.contextmanager
def _failing(what: str) -> Iterator[None]:
    """Any docker SDK or transport error inside becomes a :class:`SandboxError` saying ``what`` failed."""
    try:
        yield
    except SandboxError:
        raise
    except Exception as exc:
        raise SandboxError(f"{what}: {type(exc).__name__}: {exc}") from exc


#: tarfile's extraction filters arrived in 3.11.4; Debian bookworm's python3 (the local image) is 3.11.2.
_FILTER_ERRORS: tuple[type[BaseException], ...] = (getattr(tarfile, "FilterError", ValueError), ValueError)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> None:
    """Extract one regular file or directory under ``dest`` (the ``data`` filter, or its core where absent)."""
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, dest, filter="data")
        return
    parts = PurePosixPath(member.name).parts
    if PurePosixPath(member.name).is_absolute() or ".." in parts or not (member.isfile() or member.isdir()):
        raise ValueError(f"refused tar member {member.name!r}")
    target = dest.joinpath(*parts)
    if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    target.write_bytes(source.read())
    target.chmod(member.mode & 0o755 | 0o600)


class _Output:
    """stdout and stderr of one exec, the first ``limit`` bytes of each kept (written by one thread)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.out, self.err, self.cut = limit, bytearray(), bytearray(), False

    def add(self, out: bytes | None, err: bytes | None) -> None:
        for buf, chunk in ((self.out, out), (self.err, err)):
            if chunk:
                room = self.limit - len(buf)
                buf += chunk[:max(room, 0)]
                self.cut = self.cut or len(chunk) > room


class Docker:
    """The ``docker`` backend (see the module docstring)."""

    kind: Literal["docker"] = "docker"

    def __init__(self, settings: DockerSandbox, harness: HarnessSettings) -> None:
        try:
            import docker
        except ImportError as exc:
            raise ConfigError("sandbox type docker needs the docker SDK: pip install 'fanroute[sandbox]'") from exc
        self.settings, self.harness = settings, harness
        self.relay_base_url = f"http://127.0.0.1:{settings.relay_port}"
        url = {"base_url": settings.base_url} if settings.base_url else {}
        self.client = docker.DockerClient(**url) if url else docker.from_env()
        # Exec streams get a client without a read timeout: a harness may stay silent for its whole budget,
        # which the runner enforces itself (container.kill).
        self.stream_api = (docker.DockerClient(timeout=None, **url) if url else docker.from_env(timeout=None)).api
        self.containers: dict[Path, Any] = {}
        self._images: set[str] = set()
        self._building: dict[str, asyncio.Lock] = {}
        # A thread per rollout in flight (an exec's stream holds one for the whole command): not the loop's
        # default executor, whose few workers would queue rollouts and eat their budgets before they start.
        self._pool = ThreadPoolExecutor(max_workers=4096 + 64, thread_name_prefix="docker-sandbox")

    def _blocking(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run the SDK call ``fn(*args)`` in this backend's threads."""
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def check(self) -> None:
        """Refuse to start where no daemon answers."""
        try:
            self.client.ping()
        except Exception as exc:
            raise ConfigError(f"sandbox type docker: no Docker daemon answers ({type(exc).__name__}: {exc})") from exc

    # ------------------------------------------------------------------ the image and the container

    def _build(self, tag: str, context: bytes) -> None:
        import docker

        try:
            self.client.images.get(tag)
            return
        except docker.errors.ImageNotFound:
            pass
        try:
            self.client.images.build(fileobj=io.BytesIO(context), custom_context=True, tag=tag, rm=True,
                                     forcerm=True, pull=False, labels={LABEL: "task-image"})
        except (docker.errors.BuildError, docker.errors.APIError) as exc:
            if isinstance(exc, docker.errors.BuildError):
                lines = [str(c.get("stream") or c.get("error") or "").strip() for c in exc.build_log]
                why = f"{exc.msg} (build log: {' | '.join(ln for ln in lines if ln)[-600:]})"
            else:
                why = str(exc.explanation or exc)
            raise SandboxError(f"cannot build the task's image from environment/Dockerfile: {why}; an image that "
                               f"cannot be pulled here can be mapped with the sandbox's base_images") from exc

    async def image(self, ws: Workspace) -> str:
        """The task's image, built once per tag (concurrent rollouts of one task wait for one build)."""
        if self.harness.image:
            return self.harness.image
        tag, context = build_context(ws.task / "environment", self.settings.base_images, self.settings.harness_layer)
        if tag not in self._images:
            async with self._building.setdefault(tag, asyncio.Lock()):
                if tag not in self._images:
                    with _failing(f"cannot build the task's image {tag}"):
                        await self._blocking(self._build, tag, context)
                    self._images.add(tag)
        return tag

    def _name(self, ws: Workspace) -> str:
        return f"fanroute-{ws.root.name}-{content_id(str(ws.root), length=8)}"

    def _start(self, ws: Workspace, image: str) -> None:
        from docker.types import Mount, Ulimit

        s = self.settings
        mounts = [Mount(target, None, type="volume") for target in VOLUMES]
        mounts.append(Mount(str(Path(SOCKET_IN_SANDBOX).parent), str(ws.socket.parent), type="bind", read_only=True))
        with _failing(f"cannot create the sandbox container from {image}"):
            container = self.client.containers.create(
                image, command=["sleep", "infinity"], name=self._name(ws), hostname="sandbox", user="0:0",
                working_dir="/app", labels={LABEL: str(ws.root)}, network_mode="none", read_only=True,
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={s.tmp_mb}m"}, mounts=mounts,
                mem_limit=f"{s.memory_mb}m", memswap_limit=f"{s.memory_mb}m", pids_limit=s.pids_limit,
                nano_cpus=round(s.cpus * 1e9), cap_drop=["ALL"], security_opt=["no-new-privileges"],
                ulimits=[Ulimit(name="core", soft=0, hard=0)], stdin_open=False, tty=False)
        self.containers[ws.root] = container
        with _failing("cannot start the sandbox container"):
            container.start()
            container.put_archive("/opt/fanroute", _tar({Path(INIT_IN_SANDBOX).name: INIT.read_bytes()}))
            container.put_archive("/harness", _tar(_tree(self.harness.directory)))
            container.put_archive("/root", _tar(_tree(ws.home)))
            container.put_archive("/logs", _tar({}, ("agent", "verifier")))

    async def prepare(self, ws: Workspace) -> None:
        image = await self.image(ws)
        await self._blocking(self._start, ws, image)

    # ------------------------------------------------------------------ commands

    def _exec(self, container: Any, argv: list[str], env: Mapping[str, str], workdir: str, output: _Output) -> int:
        """Run ``argv`` in ``container``, streaming its output into ``output``; its exit status."""
        api = self.stream_api
        environment = [f"{k}={v}" for k, v in {"HOME": "/root", "LANG": "C.UTF-8", **env}.items()]
        exec_id = api.exec_create(container.id, argv, stdin=False, tty=False, environment=environment,
                                  workdir=workdir, user="0:0")["Id"]
        for out, err in api.exec_start(exec_id, stream=True, demux=True):
            output.add(out, err)
        deadline = time.monotonic() + 10
        while (state := api.exec_inspect(exec_id))["Running"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the stream can end a moment before the engine records the exit
        code = state.get("ExitCode")
        return -1 if code is None else int(code)

    def _oom_kills(self, container: Any) -> int:
        """How many processes the container's memory cgroup has OOM-killed (cgroup v1 or v2), 0 if unknown."""
        with contextlib.suppress(Exception):
            res = container.exec_run(["cat", *_OOM_FILES], user="0:0")
            return sum(int(n) for n in _OOM.findall(res.output.decode("utf-8", "replace")))
        return 0

    def _copy_out(self, container: Any, src: str, dest: Path) -> str | None:
        """Copy ``src`` (a directory) out of the container into ``dest``; a note when not all of it came."""
        import docker

        cap = self.settings.copy_out_mb << 20
        try:
            bits, _ = container.get_archive(src)
        except docker.errors.NotFound:
            return f"{src} is gone"
        buf = bytearray()
        for chunk in bits:
            buf += chunk
            if len(buf) > cap:
                return f"{src} is over copy_out_mb ({self.settings.copy_out_mb} MiB): not copied out"
        skipped = []
        with tarfile.open(fileobj=io.BytesIO(bytes(buf))) as tar:
            for member in tar:
                if member.issym() or member.islnk():
                    skipped.append(member.name)
                    continue
                try:
                    _extract(tar, member, dest)
                except (*_FILTER_ERRORS, OSError):
                    skipped.append(member.name)
        return f"not copied out of {src}: {', '.join(skipped)[:300]}" if skipped else None

    def _before_verifier(self, container: Any, ws: Workspace) -> None:
        with _failing("cannot set the sandbox up for the verifier"):
            res = container.exec_run(["python3", "-c", _BEFORE_VERIFIER], user="0:0")
            if res.exit_code != 0:
                raise SandboxError(f"cannot clear the sandbox for the verifier (status {res.exit_code}): "
                                   f"{res.output.decode('utf-8', 'replace')[-300:]}")
            container.put_archive("/tests", _tar(_tree(ws.tests)))

    def _after(self, container: Any, ws: Workspace, phase: Phase, failed: bool) -> list[str]:
        """Copy the phase's outputs back to the workspace; notes for stderr (the OOM killer, what stayed)."""
        notes = []
        if failed and (kills := self._oom_kills(container)):
            notes.append(f"[sandbox] the container's memory limit ({self.settings.memory_mb} MiB) was hit: "
                         f"{kills} process(es) OOM-killed")
        with _failing(f"cannot copy the {phase}'s outputs out of the sandbox"):
            pairs = [("/app", ws.root), ("/logs/agent", ws.logs)] if phase == "harness" else [
                ("/logs/verifier", ws.logs)]
            notes += [f"[sandbox] {note}" for src, dest in pairs if (note := self._copy_out(container, src, dest))]
        return notes

    async def run(self, ws: Workspace, phase: Phase, argv: tuple[str, ...], env: Mapping[str, str],
                  timeout_s: float, limit: int) -> CommandRun:
        container = self.containers.get(ws.root)
        if container is None:
            raise SandboxError(f"no sandbox container for {ws.root} (prepare it first)")
        if phase == "verifier":
            await self._blocking(self._before_verifier, container, ws)
            command, workdir = list(argv), "/root"
        else:
            command = ["python3", INIT_IN_SANDBOX, str(self.settings.relay_port), SOCKET_IN_SANDBOX, "--", *argv]
            workdir = "/app"
        output, started = _Output(limit), time.monotonic()
        execution = asyncio.ensure_future(self._blocking(self._exec, container, command, env, workdir, output))
        done, _ = await asyncio.wait({execution}, timeout=timeout_s)
        timed_out, code = not done, None
        if timed_out:
            with _failing("cannot kill the sandbox container at its timeout"):
                await self._blocking(self._kill, container)
            await asyncio.wait({execution}, timeout=10)  # the stream ends with the container
        else:
            with _failing(f"the {phase} could not run in the sandbox"):
                code = execution.result()
        duration = time.monotonic() - started
        notes = await self._blocking(self._after, container, ws, phase, not timed_out and code != 0)
        stderr = bytes(output.err).decode("utf-8", "replace")
        if notes:
            stderr = "\n".join([stderr.rstrip("\n"), *notes]) if stderr.strip() else "\n".join(notes)
        return CommandRun(command=argv, exit_code=code, timed_out=timed_out, timeout_s=timeout_s,
                          duration_s=round(duration, 3), stdout=bytes(output.out).decode("utf-8", "replace"),
                          stderr=stderr, truncated=output.cut)

    @staticmethod
    def _kill(container: Any) -> None:
        import docker

        try:
            container.kill()
        except docker.errors.APIError as exc:  # already stopped (409): nothing left to kill
            if exc.status_code not in (404, 409):
                raise

    def _remove(self, ws: Workspace) -> None:
        import docker

        container = self.containers.pop(ws.root, None)
        try:
            if container is None:  # created by the engine though the client never heard back, or not at all
                container = self.client.containers.get(self._name(ws))
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:  # 409: a removal already under way
            if exc.status_code != 409:
                raise

    async def close(self, ws: Workspace) -> None:
        """Remove the workspace's container and its volumes (force; also after a kill; idempotent)."""
        try:
            await self._blocking(self._remove, ws)
        except Exception as exc:
            log.warning("cannot remove the sandbox container of %s: %s", ws.root, exc)
            raise SandboxError(f"cannot remove the sandbox container of {ws.root}: {exc}") from exc
