"""The single-node KRaft broker: its config files, storage format, start-up, and the readiness
probe (list topics, then a produce) that also works for any other broker."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from devstack.base import (
    DEFAULT_KAFKA_PORT,
    FORMAT_TIMEOUT_S,
    KAFKA_READY_TIMEOUT_S,
    StackError,
    _say,
    _tail,
)
from devstack.procs import _choose_port, _ready_or_stopped, _run_in_thread

# Broker JVM: small, fixed heap for a 2-core dev box; the page cache does the real work.
KAFKA_JVM_OPTS = (
    "-Xms256m", "-Xmx512m",
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true",
)
PROBE_TOPIC = "_fanroute_stack_probe"


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
    return ("# written by devstack/kafka.py; regenerated on every start\n"
            + "".join(f"{k}={v}\n" for k, v in props.items()))


def _log4j2_properties(log_file: Path) -> str:
    return "\n".join([
        "# written by devstack/kafka.py",
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
