"""The project's real local stack, no Docker: Apache Kafka (single-node KRaft) + redis-server.

Kafka runs from its Maven Central jars (``scripts/kafka/pom.xml``), resolved once with Maven
into ``<state-dir>/kafka-libs`` and re-resolved only when the pom changes. Redis is the Debian
``redis-server`` binary (``scripts/bootstrap.sh`` installs it). Both listen on 127.0.0.1 only.

CLI::

    python -m devstack up      [--state-dir DIR] [--kafka-port N] [--redis-port N]
    python -m devstack status  [--state-dir DIR] [--json]
    python -m devstack down    [--state-dir DIR] [--wipe]
    python -m devstack prepare [--state-dir DIR]     # only resolve the jars

``up`` prints progress on stderr and ``export NAME=value`` lines on stdout, so
``eval "$(python -m devstack up)"`` points a shell at the stack. Endpoints are kept
in ``<state-dir>/stack.json``; ``up`` on a running stack only reports it.

From Python (tests): ``up(state_dir) -> StackInfo``, ``down(state_dir)``, ``status(state_dir)``.
The default state dir is ``<repo>/.stack`` (git-ignored). Broker data survives ``down``/``up``
unless ``down --wipe``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from services.common.errors import FanrouteError

REPO_ROOT = Path(__file__).resolve().parents[1]
POM = REPO_ROOT / "scripts" / "kafka" / "pom.xml"
DEFAULT_STATE_DIR = REPO_ROOT / ".stack"

DEFAULT_KAFKA_PORT = 9092
DEFAULT_REDIS_PORT = 6379
COMPONENTS = ("kafka", "redis")

KAFKA_READY_TIMEOUT_S = 120.0
REDIS_READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 30.0
FORMAT_TIMEOUT_S = 120.0
MAVEN_TIMEOUT_S = 900.0

# Broker JVM: small, fixed heap for a 2-core dev box; the page cache does the real work.
KAFKA_JVM_OPTS = (
    "-Xms256m", "-Xmx512m",
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true",
)
PROBE_TOPIC = "_fanroute_stack_probe"
# What a process's command line must contain for a pid file to still be "ours".
_DEFAULT_MARKERS = {"kafka": "kafka.Kafka", "redis": "redis-server"}
LOG_TAIL_LINES = 40


class StackError(FanrouteError, RuntimeError):
    """The local stack could not be prepared, started, or stopped."""


@dataclasses.dataclass(frozen=True)
class StackInfo:
    """Where the stack answers. A component that was not asked for is ``None``."""

    bootstrap_servers: str | None
    redis_url: str | None

    def env(self) -> dict[str, str]:
        """Environment variables that point clients and fanroute services at this stack."""
        out: dict[str, str] = {}
        if self.bootstrap_servers:
            out["KAFKA_BOOTSTRAP_SERVERS"] = self.bootstrap_servers
            out["FANROUTE_KAFKA__BOOTSTRAP_SERVERS"] = self.bootstrap_servers
        if self.redis_url:
            out["REDIS_URL"] = self.redis_url
            out["FANROUTE_REDIS__URL"] = self.redis_url
        return out


def _say(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- small helpers


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (two ``up`` at once in one state dir serialise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return f"(no {path.name})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path.name} is empty)"


def _port_free(port: int) -> bool:
    # SO_REUSEADDR like the JVM and redis do, so TIME_WAIT leftovers of our own last run
    # do not count as "taken"; a live listener still does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ephemeral ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _choose_port(requested: int | None, previous: int | None, default: int, taken: set[int]) -> int:
    """Explicit port > the one used last time > the conventional default > any free one.

    ``requested == 0`` means "any free port" (what tests use).
    """
    if requested:
        if not _port_free(requested):
            raise StackError(f"port {requested} on 127.0.0.1 is already in use")
        return requested
    if requested is None:
        for cand in (previous, default):
            if cand and cand not in taken and _port_free(cand):
                return cand
    while True:
        (port,) = _free_ports(1)
        if port not in taken:
            return port


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _pid_alive(pid: int | None, marker: str | None = None) -> bool:
    """Is ``pid`` a live (non-zombie) process, and, with ``marker``, is it still ours?"""
    if not pid:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        if done == pid:
            return False
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat[stat.rindex(")") + 2:].startswith("Z"):
                return False
            if marker is not None:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
                # Empty while a fresh child is still inside execve() (the new image's argv is
                # not mapped yet): it exists and cannot be told apart, so it counts as alive.
                return not cmdline.strip() or marker in cmdline
            return True
        except (OSError, ValueError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stop_process(pid: int, name: str, marker: str | None, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group, wait up to ``timeout``, then SIGKILL it."""
    if not _pid_alive(pid, marker):
        return
    _say(f"stopping {name} (pid {pid})")
    started = time.monotonic()
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)  # started with start_new_session=True: pgid == pid
        except ProcessLookupError:
            return
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _pid_alive(pid, marker):
                _say(f"{name} stopped in {time.monotonic() - started:.1f} s")
                return
            time.sleep(0.1)
        if sig == signal.SIGTERM:
            _say(f"{name} did not exit within {wait_s:.0f} s of SIGTERM; sending SIGKILL")
    raise StackError(f"{name} (pid {pid}) survived SIGKILL")


def _stop_child(proc: subprocess.Popen[bytes], name: str, timeout: float) -> None:
    """Stop a process this one started (its Popen is the reliable liveness source)."""
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    raise StackError(f"{name} (pid {proc.pid}) survived SIGKILL")


def _run_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread and return its result (keeps asyncio.run away from any
    event loop the caller, e.g. pytest-asyncio, owns in this thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="stack-probe", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@contextlib.contextmanager
def _quiet_aiokafka() -> Iterator[None]:
    """aiokafka logs every refused connection at ERROR while the broker boots; mute it."""
    log = logging.getLogger("aiokafka")
    old = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)


# --------------------------------------------------------------------------- state file


def _state_path(state_dir: Path) -> Path:
    return state_dir / "stack.json"


def _read_state(state_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(_state_path(state_dir).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(state_dir: Path, state: dict[str, Any]) -> None:
    path = _state_path(state_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _info_from_state(state: dict[str, Any]) -> StackInfo:
    return StackInfo(bootstrap_servers=(state.get("kafka") or {}).get("bootstrap_servers"),
                     redis_url=(state.get("redis") or {}).get("url"))


# --------------------------------------------------------------------------- kafka jars


def _pom_digest(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def _libs_ready(libs_dir: Path, digest: str) -> bool:
    stamp = libs_dir / ".pom-sha256"
    try:
        ok = stamp.read_text().strip() == digest
    except OSError:
        return False
    return ok and any(libs_dir.glob("kafka_2.13-*.jar")) and any(libs_dir.glob("kafka-server-*.jar"))


def prepare(state_dir: Path | str = DEFAULT_STATE_DIR, *, libs_dir: Path | str | None = None,
            pom: Path = POM) -> Path:
    """Resolve the broker jars with Maven into ``libs_dir`` (default ``<state_dir>/kafka-libs``).

    Skipped when the jars there were resolved from a pom with the same hash.
    """
    libs = (Path(libs_dir) if libs_dir else Path(state_dir) / "kafka-libs").resolve()
    if not pom.is_file():
        raise StackError(f"{pom} is missing: the Kafka jars are resolved from it")
    digest = _pom_digest(pom)
    if _libs_ready(libs, digest):
        return libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    with _locked(libs.parent / f".{libs.name}.lock"):
        if _libs_ready(libs, digest):  # someone else resolved them while we waited
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError("Maven (`mvn`) is not on PATH; it resolves the Kafka jars from Maven "
                             "Central. Run scripts/bootstrap.sh (or `apt-get install -y maven`).")
        tmp = libs.parent / f".{libs.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _say(f"resolving Kafka jars from {pom} into {libs} (Maven; once per pom version)")
        started = time.monotonic()
        cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
               f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=MAVEN_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(f"Maven did not finish within {MAVEN_TIMEOUT_S:.0f} s") from exc
        if res.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            out = "\n".join((res.stdout + res.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise StackError(f"Maven could not resolve the Kafka jars (exit {res.returncode}):\n{out}")
        (tmp / ".pom-sha256").write_text(digest + "\n")
        old = libs.parent / f".{libs.name}.old-{os.getpid()}"
        if libs.exists():
            libs.rename(old)
        tmp.rename(libs)
        shutil.rmtree(old, ignore_errors=True)
        n = len(list(libs.glob("*.jar")))
        _say(f"resolved {n} jars in {time.monotonic() - started:.1f} s")
    return libs


# --------------------------------------------------------------------------- kafka


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise StackError("`java` is not on PATH; Kafka 4.x needs Java 17+. Run scripts/bootstrap.sh "
                         "(or `apt-get install -y openjdk-17-jre-headless`).")
    return java


def _new_cluster_id() -> str:
    while True:  # Kafka's own Uuid.randomUuid() also never starts with '-'
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _server_properties(port: int, controller_port: int, data_dir: Path) -> str:
    # Static quorum (controller.quorum.voters): the voter endpoint is not written into the
    # metadata log, so ports may change between restarts of the same data dir.
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "auto.create.topics.enable": "true",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    return ("# written by devstack/stack.py; regenerated on every start\n"
            + "".join(f"{k}={v}\n" for k, v in props.items()))


def _log4j2_properties(log_file: Path) -> str:
    return "\n".join([
        "# written by devstack/stack.py",
        "status = warn",
        "name = fanroute-stack-kafka",
        # Kafka flushes its own shutdown; log4j's hook would stop logging half-way through it.
        "shutdownHook = disable",
        "appender.file.type = File",
        "appender.file.name = FILE",
        f"appender.file.fileName = {log_file}",
        "appender.file.append = true",
        "appender.file.layout.type = PatternLayout",
        "appender.file.layout.pattern = [%d] %p %m (%c)%n",
        "rootLogger.level = INFO",
        "rootLogger.appenderRef.file.ref = FILE",
        "logger.request.name = kafka.request.logger",
        "logger.request.level = WARN",
        "",
    ])


async def _probe_kafka_once(bootstrap: str, timeout_s: float) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    ms = int(max(1.0, timeout_s) * 1000)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ms,
                                client_id="fanroute-stack-probe")
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        await asyncio.wait_for(admin.list_topics(), timeout_s)
    finally:
        await admin.close()
    # Metadata alone does not prove partitions get leaders and logs get written: produce.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=ms, acks="all",
                                client_id="fanroute-stack-probe")
    await asyncio.wait_for(producer.start(), timeout_s)
    try:
        await asyncio.wait_for(producer.send_and_wait(PROBE_TOPIC, b"ping"), timeout_s)
    finally:
        await producer.stop()


def wait_kafka_ready(bootstrap: str, timeout_s: float = KAFKA_READY_TIMEOUT_S, *,
                     alive: Callable[[], bool] | None = None,
                     logs: Sequence[Path] = ()) -> float:
    """Block until the broker at ``bootstrap`` lists topics and accepts a produce.

    ``alive`` (optional) says whether the broker process still runs, to fail fast; ``logs``
    are tailed into the error. Returns the seconds waited. Usable for any broker (testcontainers).
    """
    started = time.monotonic()
    deadline = started + timeout_s
    host, _, port_s = bootstrap.split(",")[0].rpartition(":")
    last: BaseException | None = None

    def failure(why: str) -> StackError:
        parts = [f"Kafka at {bootstrap} {why}"]
        if last is not None:
            parts.append(f"last probe error: {type(last).__name__}: {last}")
        parts += [f"--- tail of {p} ---\n{_tail(p)}" for p in logs]
        return StackError("\n".join(parts))

    while True:
        now = time.monotonic()
        if alive is not None and not alive():
            raise failure("exited during start-up")
        if now >= deadline:
            raise failure(f"did not become ready within {timeout_s:g} s")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port_s)), timeout=1.0):
                pass
        except OSError as exc:
            last = exc
            time.sleep(0.2)
            continue
        budget = min(15.0, max(1.0, deadline - time.monotonic()))
        try:
            with _quiet_aiokafka():
                _run_in_thread(lambda: asyncio.run(_probe_kafka_once(bootstrap, budget)))
            return time.monotonic() - started
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"; reported at the end
            last = exc
            time.sleep(0.5)


def _start_kafka(state_dir: Path, port_req: int | None, libs: Path, prev: dict[str, Any],
                 taken: set[int], timeout_s: float) -> dict[str, Any]:
    kdir = state_dir / "kafka"
    data = kdir / "data"
    kdir.mkdir(parents=True, exist_ok=True)
    props_path, log4j_path = kdir / "server.properties", kdir / "log4j2.properties"
    broker_log, out_log = kdir / "broker.log", kdir / "kafka.out"
    java = _java()

    port = _choose_port(port_req, prev.get("port"), DEFAULT_KAFKA_PORT, taken)
    cport = _choose_port(None, prev.get("controller_port"), 0, taken | {port})
    props_path.write_text(_server_properties(port, cport, data))
    log4j_path.write_text(_log4j2_properties(broker_log))
    classpath = f"{libs}/*"
    log_opt = f"-Dlog4j2.configurationFile={log4j_path}"

    meta = data / "meta.properties"
    if meta.exists():
        cluster_id = next((ln.split("=", 1)[1].strip() for ln in meta.read_text().splitlines()
                           if ln.startswith("cluster.id=")), prev.get("cluster_id", "?"))
    else:
        cluster_id = _new_cluster_id()
        _say(f"formatting KRaft storage in {data} (cluster id {cluster_id})")
        shutil.rmtree(data, ignore_errors=True)
        # No log4j2 config here: log4j's default (errors to the console) is what we capture.
        cmd = [java, "-Xmx256m", "-cp", classpath, "kafka.tools.StorageTool", "format",
               "-t", cluster_id, "-c", str(props_path)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=FORMAT_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL, cwd=kdir)
        except subprocess.TimeoutExpired as exc:
            raise StackError(f"kafka storage format did not finish in {FORMAT_TIMEOUT_S:.0f} s") from exc
        if res.returncode != 0 or not meta.exists():
            raise StackError(f"kafka storage format failed (exit {res.returncode}):\n"
                             f"{res.stdout}{res.stderr}\n--- tail of {broker_log} ---\n{_tail(broker_log)}")

    _say(f"starting Kafka broker on 127.0.0.1:{port} (controller 127.0.0.1:{cport})")
    with open(out_log, "ab") as out:
        out.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [java, *KAFKA_JVM_OPTS, log_opt, f"-Dkafka.logs.dir={kdir}", "-cp", classpath,
             "kafka.Kafka", str(props_path)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=kdir,
            start_new_session=True)
    (state_dir / "kafka.pid").write_text(f"{proc.pid}\n")
    marker = str(props_path)
    bootstrap = f"127.0.0.1:{port}"
    waited = _ready_or_stopped(proc, "kafka", state_dir, 10.0, lambda alive: wait_kafka_ready(
        bootstrap, timeout_s, alive=alive, logs=(broker_log, out_log)))
    _say(f"kafka ready at {bootstrap} in {waited:.1f} s")
    return {"pid": proc.pid, "port": port, "controller_port": cport, "cluster_id": cluster_id,
            "bootstrap_servers": bootstrap, "marker": marker, "libs": str(libs),
            "log": str(broker_log), "ready_s": round(waited, 2)}


# --------------------------------------------------------------------------- redis


def _redis_ping(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_redis_ready(url: str, timeout_s: float = REDIS_READY_TIMEOUT_S, *,
                     alive: Callable[[], bool] | None = None, logs: Sequence[Path] = ()) -> float:
    """Block until PING at ``url`` answers; returns the seconds waited."""
    started = time.monotonic()
    while not _redis_ping(url):
        if alive is not None and not alive():
            why = "exited during start-up"
        elif time.monotonic() - started > timeout_s:
            why = f"did not answer PING within {timeout_s:g} s"
        else:
            time.sleep(0.1)
            continue
        tails = "".join(f"\n--- tail of {p} ---\n{_tail(p)}" for p in logs)
        raise StackError(f"redis at {url} {why}{tails}")
    return time.monotonic() - started


def _start_redis(state_dir: Path, port_req: int | None, prev: dict[str, Any], taken: set[int],
                 timeout_s: float) -> dict[str, Any]:
    server = shutil.which("redis-server")
    if server is None:
        raise StackError("redis-server is not installed. Install it with "
                         "`apt-get install -y redis-server` (scripts/bootstrap.sh does this).")
    rdir = state_dir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    log, out_log = rdir / "redis.log", rdir / "redis.out"
    port = _choose_port(port_req, prev.get("port"), DEFAULT_REDIS_PORT, taken)
    _say(f"starting redis-server on 127.0.0.1:{port}")
    with open(out_log, "ab") as out:
        proc = subprocess.Popen(
            [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--protected-mode", "yes", "--dir", str(rdir), "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=rdir,
            start_new_session=True)
    (state_dir / "redis.pid").write_text(f"{proc.pid}\n")
    url = f"redis://127.0.0.1:{port}/0"
    marker = "redis-server"
    waited = _ready_or_stopped(proc, "redis", state_dir, 5.0, lambda alive: wait_redis_ready(
        url, timeout_s, alive=alive, logs=(log, out_log)))
    _say(f"redis ready at {url} in {waited:.1f} s")
    return {"pid": proc.pid, "port": port, "url": url, "marker": marker, "log": str(log),
            "ready_s": round(waited, 2)}


def _ready_or_stopped(proc: subprocess.Popen, name: str, state_dir: Path, stop_timeout_s: float,
                      wait: Callable[[Callable[[], bool]], float]) -> float:
    """Wait until a just-started child answers; if it never does, stop it and drop its pid file."""
    try:
        return wait(lambda: proc.poll() is None)
    except BaseException:
        _stop_child(proc, name, timeout=stop_timeout_s)
        (state_dir / f"{name}.pid").unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- public API


def _running(state_dir: Path, name: str, entry: dict[str, Any]) -> bool:
    pid = _read_pid(state_dir / f"{name}.pid")
    return pid is not None and pid == entry.get("pid") and _pid_alive(pid, entry.get("marker"))


def up(state_dir: Path | str = DEFAULT_STATE_DIR, kafka_port: int | None = None,
       redis_port: int | None = None, *, libs_dir: Path | str | None = None,
       components: Sequence[str] = COMPONENTS,
       kafka_timeout_s: float = KAFKA_READY_TIMEOUT_S) -> StackInfo:
    """Start (or find running) the components in ``state_dir`` and return their endpoints.

    Ports: the given one, else the one used last time, else 9092/6379, else any free one;
    ``0`` means any free port. ``libs_dir`` shares one jar cache between state dirs.
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown stack components {sorted(unknown)}; known: {COMPONENTS}")
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state_dir / ".lock"):
        state = _read_state(state_dir)
        taken: set[int] = set()
        for name in COMPONENTS:
            entry = state.get(name) or {}
            if _running(state_dir, name, entry):
                taken.update(p for p in (entry.get("port"), entry.get("controller_port")) if p)

        if "kafka" in components:
            entry = state.get("kafka") or {}
            if _running(state_dir, "kafka", entry):
                _say(f"kafka already running at {entry['bootstrap_servers']} (pid {entry['pid']})")
                wait_kafka_ready(entry["bootstrap_servers"], 30.0,
                                 alive=lambda: _pid_alive(entry["pid"], entry.get("marker")),
                                 logs=(Path(entry.get("log", state_dir / "kafka" / "broker.log")),))
            else:
                (state_dir / "kafka.pid").unlink(missing_ok=True)
                libs = prepare(state_dir, libs_dir=libs_dir)
                entry = _start_kafka(state_dir, kafka_port, libs, entry, taken, kafka_timeout_s)
                taken.update((entry["port"], entry["controller_port"]))
                state["kafka"] = entry
                _write_state(state_dir, state)

        if "redis" in components:
            entry = state.get("redis") or {}
            if _running(state_dir, "redis", entry):
                _say(f"redis already running at {entry['url']} (pid {entry['pid']})")
                wait_redis_ready(entry["url"], 5.0)
            else:
                (state_dir / "redis.pid").unlink(missing_ok=True)
                state["redis"] = _start_redis(state_dir, redis_port, entry, taken, REDIS_READY_TIMEOUT_S)
                _write_state(state_dir, state)

        info = _info_from_state(state)
        return StackInfo(bootstrap_servers=info.bootstrap_servers if "kafka" in components else None,
                         redis_url=info.redis_url if "redis" in components else None)


def down(state_dir: Path | str = DEFAULT_STATE_DIR, *, wipe: bool = False) -> None:
    """Stop whatever runs from ``state_dir`` (SIGTERM, then SIGKILL after a deadline).

    ``wipe`` also deletes the broker data (the jar cache is kept).
    """
    state_dir = Path(state_dir).resolve()
    if not state_dir.exists():
        return
    with _locked(state_dir / ".lock"):
        state = _read_state(state_dir)
        for name in ("redis", "kafka"):
            entry = state.get(name) or {}
            pidfile = state_dir / f"{name}.pid"
            pid = _read_pid(pidfile) or entry.get("pid")
            if pid:
                _stop_process(pid, name, entry.get("marker") or _DEFAULT_MARKERS[name])
            elif entry:
                _say(f"{name} was not running")
            pidfile.unlink(missing_ok=True)
            if entry:
                entry.pop("pid", None)
                entry["stopped_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if state:
            _write_state(state_dir, state)  # keep the ports so the next `up` reuses them
        if wipe:
            shutil.rmtree(state_dir / "kafka" / "data", ignore_errors=True)
            _say("wiped the broker data")


def status(state_dir: Path | str = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """What runs from ``state_dir``: per component ``running``, endpoint and pid."""
    state_dir = Path(state_dir).resolve()
    state = _read_state(state_dir)
    out: dict[str, Any] = {"state_dir": str(state_dir)}
    for name in COMPONENTS:
        entry = state.get(name) or {}
        running = _running(state_dir, name, entry)
        endpoint = entry.get("bootstrap_servers") if name == "kafka" else entry.get("url")
        out[name] = {"running": running, "endpoint": endpoint,
                     "answering": bool(running and entry.get("port") and _port_open(entry["port"])),
                     "pid": entry.get("pid") if running else None, "log": entry.get("log")}
    return out


# --------------------------------------------------------------------------- CLI


def _print_env(info: StackInfo) -> None:
    for key, value in info.env().items():
        print(f"export {key}={value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack",
                                     description="Local Kafka (KRaft, from Maven jars) + redis-server.")
    parser.add_argument("command", choices=("up", "down", "status", "prepare"))
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help="where jars, data, logs, pid files and stack.json live (default: %(default)s)")
    parser.add_argument("--kafka-port", type=int, default=None, help="Kafka port (0 = any free)")
    parser.add_argument("--redis-port", type=int, default=None, help="Redis port (0 = any free)")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("--wipe", action="store_true", help="down: also delete the broker data")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            libs = prepare(args.state_dir)
            _say(f"Kafka jars ready in {libs}")
        elif args.command == "up":
            started = time.monotonic()
            info = up(args.state_dir, args.kafka_port, args.redis_port)
            took = time.monotonic() - started
            _say(f"stack up in {took:.1f} s (state in {Path(args.state_dir).resolve()})")
            _print_env(info)
        elif args.command == "down":
            down(args.state_dir, wipe=args.wipe)
            _say("stack down")
        else:
            st = status(args.state_dir)
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                for name in COMPONENTS:
                    c = st[name]
                    what = (f"running, {'answering' if c['answering'] else 'NOT answering'} at "
                            f"{c['endpoint']} (pid {c['pid']})") if c["running"] else "stopped"
                    print(f"{name}: {what}")
            return 0 if all(st[n]["running"] and st[n]["answering"] for n in COMPONENTS) else 1
    except StackError as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
