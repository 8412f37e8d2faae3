"""The project's local stack for development and tests, no Docker: Apache Kafka + redis-server.

``python -m devstack up|status|down|prepare`` (``make stack-up``); from Python (tests)
``up(state_dir) -> StackInfo``, ``down(state_dir)``, ``status(state_dir)``. Developer tooling:
nothing in ``services`` imports it at run time.
"""

from devstack.stack import (
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
    _new_cluster_id,
    down,
    main,
    prepare,
    status,
    up,
    wait_kafka_ready,
    wait_redis_ready,
)

__all__ = [
    "COMPONENTS", "DEFAULT_KAFKA_PORT", "DEFAULT_REDIS_PORT", "DEFAULT_STATE_DIR",
    "KAFKA_READY_TIMEOUT_S", "POM", "REDIS_READY_TIMEOUT_S", "REPO_ROOT", "StackError", "StackInfo",
    "down", "main", "prepare", "status", "up", "wait_kafka_ready", "wait_redis_ready",
]
