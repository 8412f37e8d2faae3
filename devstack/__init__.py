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

Developer tooling, not part of the runtime library: nothing in ``services`` imports it (the
``fanroute stack``/``demo`` commands and the test fixtures do, late). Modules: ``cli`` (the
command line), ``stack`` (up/down/status), ``kafka`` and ``jars`` (the broker and its Maven jars),
``redis``, ``procs`` (ports and processes), ``state`` (``stack.json``), ``base`` (paths, errors).
"""

from devstack.base import (
    COMPONENTS,
    DEFAULT_KAFKA_PORT,
    DEFAULT_REDIS_PORT,
    DEFAULT_STATE_DIR,
    KAFKA_READY_TIMEOUT_S,
    POM,
    REDIS_READY_TIMEOUT_S,
    REPO_ROOT,
    StackError,
    StackInfo,
)
from devstack.cli import main
from devstack.jars import prepare
from devstack.kafka import (
    _new_cluster_id as _new_cluster_id,  # the test fixtures use it
)
from devstack.kafka import wait_kafka_ready
from devstack.redis import wait_redis_ready
from devstack.stack import down, status, up

__all__ = [
    "COMPONENTS", "DEFAULT_KAFKA_PORT", "DEFAULT_REDIS_PORT", "DEFAULT_STATE_DIR",
    "KAFKA_READY_TIMEOUT_S", "POM", "REDIS_READY_TIMEOUT_S", "REPO_ROOT", "StackError", "StackInfo",
    "down", "main", "prepare", "status", "up", "wait_kafka_ready", "wait_redis_ready",
]
