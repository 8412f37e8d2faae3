"""A Docker daemon for the tests marked ``docker``, the harness image they map the task's ``python:3.11-slim``
to, and the sandbox settings and leftovers they check.

The daemon is started the way the compose tests start it (``scripts/docker.sh start``, as root); a machine
where it still does not answer fails the test with the reason, it never skips. Images are built only from
the local stand-in ``fanroute/python:3.11-local`` (nothing can be pulled here): the harness image adds the
router harness's one dependency, ``openai``, by copying its installed distributions (and theirs) from this
interpreter's site-packages (the same Python 3.11 on the same Debian), so no package index is needed.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from schemas.base import content_id
from services.rollouts.docker_sandbox import LABEL
from services.rollouts.settings import DockerSandbox

REPO = Path(__file__).resolve().parents[2]
DOCKER_SH = REPO / "scripts" / "docker.sh"
BASE_IMAGE = "fanroute/python:3.11-local"
TASK_BASE = "python:3.11-slim"  # what the replay tasks' environment/Dockerfile names
SITE_IN_IMAGE = "/opt/python/lib/python3.11/site-packages"


class EngineUnavailable(RuntimeError):
    """No Docker daemon answers, or the local base image is missing, even after trying to provide them."""


def _docker_info() -> str | None:
    """None when ``docker info`` answers, else why not."""
    try:
        res = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if res.returncode == 0 else (res.stderr or res.stdout).strip()[-2000:]


def _script(step: str) -> str:
    res = subprocess.run(["bash", str(DOCKER_SH), step], cwd=REPO, capture_output=True, text=True, timeout=1800,
                         check=False)
    return f"`scripts/docker.sh {step}` exited {res.returncode}: {(res.stderr + res.stdout).strip()[-3000:]}"


def ensure_engine() -> Any:
    """A docker SDK client of a daemon that answers, with the local base image present (started/built if not)."""
    if (why := _docker_info()) is not None:
        started = _script("start")
        if (still := _docker_info()) is not None:
            raise EngineUnavailable(f"no Docker daemon answers (`docker info`: {why}); tried {started}; "
                                    f"`docker info` still says: {still}")
    try:
        import docker
    except ImportError:
        raise EngineUnavailable("the docker SDK is not installed (pip install -e '.[dev]')") from None
    client = docker.from_env()
    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        built = _script("images")
        try:
            client.images.get(BASE_IMAGE)
        except docker.errors.ImageNotFound:
            raise EngineUnavailable(f"the local base image {BASE_IMAGE} is missing; tried {built}") from None
    return client


def _closure(name: str) -> list[metadata.Distribution]:
    """``name``'s installed distribution and those it requires (no extras), each once."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in seen:
            continue
        dist = seen[key] = metadata.distribution(key)
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def harness_image(client: Any) -> str:
    """``fanroute/python:3.11-local`` with ``openai`` (and what it needs) in its site-packages; built once."""
    dists = _closure("openai")
    dockerfile = f"FROM {BASE_IMAGE}\nCOPY site/ {SITE_IN_IMAGE}/\n"
    tag = "fanroute-test/harness-python:" + content_id(
        dockerfile, [[d.metadata["Name"], d.version] for d in dists], length=16)
    import docker

    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for dist in dists:
            for rel in dist.files or ():
                if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                    continue  # scripts outside site-packages; bytecode is rebuilt
                tar.add(str(dist.locate_file(rel)), arcname=f"site/{rel.as_posix()}", recursive=False)
    client.images.build(fileobj=io.BytesIO(buf.getvalue()), custom_context=True, tag=tag, rm=True, pull=False)
    return tag


def docker_sandbox(image: str, **kw: Any) -> DockerSandbox:
    """Docker sandbox settings whose task images are built on ``image`` (the replay tasks' base mapped to it)."""
    return DockerSandbox(base_images={TASK_BASE: image}, **kw)


def sandbox_containers(client: Any, under: Path) -> list[Any]:
    """The rollout containers the engine still holds (running or not) whose workspace is under ``under``."""
    return [c for c in client.containers.list(all=True, filters={"label": LABEL})
            if Path(c.labels[LABEL]).is_relative_to(under)]
