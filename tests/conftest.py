"""Session fixtures for the real Kafka broker and Redis (``tests/integration``, ``tests/e2e``).

Where they come from, first match wins:

1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` in the environment (CI or a stack you run);
2. the project's own local stack (``devstack``): broker data in a session temp
   dir, jars from the shared cache ``<repo>/.stack/kafka-libs``, any free ports;
3. with ``FANROUTE_TEST_STACK=docker``: containers started through testcontainers from the
   local images ``scripts/docker.sh images`` builds offline (``fanroute/kafka:4.1.1-local``,
   ``fanroute/redis:7.0-local``; ``FANROUTE_TEST_KAFKA_IMAGE`` / ``FANROUTE_TEST_REDIS_IMAGE``
   name others, e.g. the official ones where Docker Hub answers). Never pulled: a missing
   image fails with the command that builds it. ``.ci/run`` runs the broker and Redis
   integration tests this way once; the rest of the suite runs on devstack's processes, whose
   pids the fault tests signal directly.

``FANROUTE_TEST_STACK=env|docker|local`` forces a source (``env`` = fail if the variables
are missing). Nothing starts until a test asks for it, so ``pytest tests/unit`` starts
nothing; what the session started is stopped at its end. A test marked ``kafka``/``redis``
whose service cannot be started FAILS with the reason and the broker log; it is never skipped.

Tests marked ``docker`` (the docker sandbox backend) get a Docker daemon the same way: one that answers, or
``scripts/docker.sh start`` (as root), or the test fails with why (tests/support/docker_engine.py).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

import devstack as stack
from tests.support.serving import free_port

REPO = Path(__file__).resolve().parents[1]
SHARED_LIBS = REPO / ".stack" / "kafka-libs"
KAFKA_IMAGE = os.environ.get("FANROUTE_TEST_KAFKA_IMAGE", "fanroute/kafka:4.1.1-local")
REDIS_IMAGE = os.environ.get("FANROUTE_TEST_REDIS_IMAGE", "fanroute/redis:7.0-local")
_MARKED = {"kafka": "kafka_bootstrap", "redis": "redis_url", "docker": "docker_engine"}
_FAIL_PREFIX = "[fanroute tests]"


class ServiceUnavailable(stack.StackError):
    """A test needs Kafka or Redis and the session could not provide it."""


# --------------------------------------------------------------------------- sources


def _docker_daemon_answers(timeout: float = 0.5) -> bool:
    """A fast ping of the Docker daemon's socket (no client library needed)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(host[len("unix://"):])
        elif host.startswith("tcp://"):
            hostname, _, port = host[len("tcp://"):].rstrip("/").rpartition(":")
            sock = socket.create_connection((hostname, int(port)), timeout=timeout)
        else:
            return False
        with sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(256)
    except (OSError, ValueError):
        return False


class _Services:
    """Starts each service at most once per session, on first use; remembers failures."""

    def __init__(self, tmp_factory: pytest.TempPathFactory) -> None:
        self._tmp_factory = tmp_factory
        self._state_dir: Path | None = None
        self._containers: list[Any] = []
        self._endpoints: dict[str, str] = {}
        self._errors: dict[str, ServiceUnavailable] = {}

    # which source: env, docker or local
    def _source(self, name: str) -> str:
        env_var = "KAFKA_BOOTSTRAP_SERVERS" if name == "kafka" else "REDIS_URL"
        forced = os.environ.get("FANROUTE_TEST_STACK", "").strip().lower()
        if forced and forced not in ("env", "docker", "local"):
            raise ServiceUnavailable(f"FANROUTE_TEST_STACK={forced!r}: expected env, docker or local")
        if os.environ.get(env_var) and forced in ("", "env"):
            return "env"
        if forced == "env":
            raise ServiceUnavailable(f"FANROUTE_TEST_STACK=env but {env_var} is not set")
        if forced != "docker":
            return "local"
        if not _docker_daemon_answers():
            raise ServiceUnavailable("FANROUTE_TEST_STACK=docker but no Docker daemon answers "
                                     "(bash scripts/docker.sh start)")
        try:
            import testcontainers.core.container  # noqa: F401 - the dev extra installs it
        except ImportError:
            raise ServiceUnavailable("FANROUTE_TEST_STACK=docker but the `testcontainers` package is not "
                                     "installed (pip install -e '.[dev]')") from None
        return "docker"

    def get(self, name: str) -> str:
        if name in self._endpoints:
            return self._endpoints[name]
        if name in self._errors:
            raise self._errors[name]
        try:
            source = self._source(name)
            if source == "env":
                endpoint = os.environ["KAFKA_BOOTSTRAP_SERVERS" if name == "kafka" else "REDIS_URL"]
            elif source == "docker":
                endpoint = self._start_container(name)
            else:
                endpoint = self._start_local(name)
        except Exception as exc:  # noqa: BLE001 - every cause becomes one clear failure
            err = exc if isinstance(exc, ServiceUnavailable) else ServiceUnavailable(
                f"could not start {name} for the tests: {type(exc).__name__}: {exc}")
            self._errors[name] = err
            raise err from None
        self._endpoints[name] = endpoint
        return endpoint

    def _start_local(self, name: str) -> str:
        if self._state_dir is None:
            self._state_dir = self._tmp_factory.mktemp("stack")
        # Port 0 = any free port: never collide with a developer's `make stack-up` on 9092/6379.
        info = stack.up(self._state_dir, kafka_port=0, redis_port=0, libs_dir=SHARED_LIBS,
                        components=(name,))
        endpoint = info.bootstrap_servers if name == "kafka" else info.redis_url
        assert endpoint, f"stack.up returned no endpoint for {name}"
        return endpoint

    def _start_container(self, name: str) -> str:
        # No Ryuk reaper: its image would be pulled; close() stops what the session started.
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        import docker
        from testcontainers.core.container import DockerContainer

        image = REDIS_IMAGE if name == "redis" else KAFKA_IMAGE
        try:
            docker.from_env().images.get(image)
        except docker.errors.ImageNotFound:
            raise ServiceUnavailable(f"image {image} is not on this machine (nothing is pulled): build the local "
                                     f"images with `bash scripts/docker.sh images`") from None
        port = free_port()
        if name == "redis":
            container = DockerContainer(REDIS_IMAGE).with_bind_ports(6379, port)
            container.with_command("redis-server --save '' --appendonly no")
            container.start()
            self._containers.append(container)
            url = f"redis://127.0.0.1:{port}/0"
            stack.wait_redis_ready(url, 60.0)
            return url
        # The official image, configured by env; the broker advertises the host-side port.
        container = DockerContainer(KAFKA_IMAGE).with_bind_ports(9092, port)
        for key, value in {
            "KAFKA_NODE_ID": "1",
            "KAFKA_PROCESS_ROLES": "broker,controller",
            "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
            "CLUSTER_ID": stack._new_cluster_id(),
            "KAFKA_NUM_PARTITIONS": "1",
            "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "true",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
            "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
            "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
            "KAFKA_HEAP_OPTS": "-Xms256m -Xmx512m",
        }.items():
            container.with_env(key, value)
        container.start()
        self._containers.append(container)
        bootstrap = f"127.0.0.1:{port}"
        stack.wait_kafka_ready(bootstrap, stack.KAFKA_READY_TIMEOUT_S)
        return bootstrap

    def close(self) -> None:
        errors = []
        for container in reversed(self._containers):
            try:
                container.stop()
            except Exception as exc:  # noqa: BLE001 - stop the rest, report at the end
                errors.append(exc)
        if self._state_dir is not None:
            stack.down(self._state_dir)
        if errors:
            raise errors[0]


# --------------------------------------------------------------------------- fixtures


def _require(services: _Services, name: str) -> str:
    try:
        return services.get(name)
    except ServiceUnavailable as exc:
        reason = str(exc)
    pytest.fail(f"{_FAIL_PREFIX} {name} is needed but unavailable:\n{reason}", pytrace=False)


@pytest.fixture(scope="session")
def _services(tmp_path_factory: pytest.TempPathFactory):
    services = _Services(tmp_path_factory)
    yield services
    services.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(_services: _Services) -> str:
    """``host:port`` of a real Apache Kafka 4.x broker for this session."""
    return _require(_services, "kafka")


@pytest.fixture(scope="session")
def redis_url(_services: _Services) -> str:
    """``redis://`` URL of a real Redis for this session."""
    return _require(_services, "redis")


@pytest.fixture(scope="session")
def docker_engine() -> Any:
    """A docker SDK client of a Docker daemon that answers (started by scripts/docker.sh if none did)."""
    from tests.support.docker_engine import EngineUnavailable, ensure_engine

    try:
        return ensure_engine()
    except EngineUnavailable as exc:
        reason = str(exc)
    pytest.fail(f"{_FAIL_PREFIX} docker is needed but unavailable:\n{reason}", pytrace=False)


@pytest.fixture(scope="session")
def docker_harness_image(docker_engine: Any) -> str:
    """The image the replay tasks' ``python:3.11-slim`` is mapped to: the local stand-in plus ``openai``."""
    from tests.support.docker_engine import harness_image

    return harness_image(docker_engine)


@pytest.fixture(params=[pytest.param("bwrap", marks=pytest.mark.skipif(
                            shutil.which("bwrap") is None, reason="bubblewrap is not installed "
                            "(scripts/bootstrap.sh installs it)")),
                        pytest.param("docker", marks=pytest.mark.docker)])
def sandbox_backend(request: pytest.FixtureRequest) -> Any:
    """Each sandbox backend's settings in turn: bwrap, and docker with the replay tasks' base image mapped to
    :func:`docker_harness_image`."""
    if request.param == "docker":
        from tests.support.docker_engine import docker_sandbox

        return docker_sandbox(request.getfixturevalue("docker_harness_image"))
    from services.rollouts.settings import BwrapSandbox

    return BwrapSandbox()


@pytest.fixture
def fanroute_env(kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point ``FANROUTE_*`` settings (and plain client env vars) at the session's services."""
    env = stack.StackInfo(bootstrap_servers=kafka_bootstrap, redis_url=redis_url).env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name no other test uses: ``test.<test name>.<uuid>``."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:80].strip("-.") or "t"
    return f"test.{base}.{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def _own_trace_spool(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's gateways (in process or started from it) spool traces in a directory of their own,
    never in the user's ``~/.cache/fanroute/spool``; a test may still set its own ``spool_dir``."""
    monkeypatch.setenv("FANROUTE_SPOOL_DIR", str(tmp_path_factory.mktemp("spool")))


@pytest.fixture(autouse=True)
def _marked_services_must_start(request: pytest.FixtureRequest) -> None:
    """A test marked ``kafka``/``redis`` gets its service started even if it does not ask for
    the fixture, and fails (never skips) when the service cannot be started."""
    for marker, fixture in _MARKED.items():
        if request.node.get_closest_marker(marker) is None:
            continue
        request.getfixturevalue(fixture)  # fails the test (see _require) if it cannot start


# --------------------------------------------------------------------------- reporting


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when == "setup" and report.failed and call.excinfo is not None and (
            call.excinfo.errisinstance(stack.StackError)
            or (call.excinfo.errisinstance(pytest.fail.Exception)
                and str(call.excinfo.value).startswith(_FAIL_PREFIX))):
        report._fanroute_service_unavailable = True  # type: ignore[attr-defined]
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    # pytest files a setup failure under "error"; a needed service that will not start is a
    # failure of the test run, so count and show it as FAILED.
    if getattr(report, "_fanroute_service_unavailable", False):
        return "failed", "F", "FAILED"
    return None
