"""A promoted linear router over the benchmark's synthetic providers, for the gateway's routed runs.

Each provider ``p<i>`` owns a topic (a word list); the benchmark's queries are drawn from the topics in
turn, so the router sends a third of the traffic to each provider. The router is fitted on episodes
labelled by topic (the linear router's real ``fit``), published to a real publisher (its own process,
stamps in Redis) and promoted, exactly as ``fanroute linear fit`` and the promotion rule would.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = (
    "supersonic wing flow shock airfoil mach boundary layer flutter nozzle".split(),
    "protein heart cells mouse tumour enzyme liver patients drug kidney".split(),
    "library catalogue indexing retrieval thesaurus citation abstracts journals classification".split(),
)
MODEL_ID = "router"


def bench_query(n: int, providers: int) -> str:
    """The n-th benchmark query: two words of topic ``n mod providers`` and a serial (each query distinct)."""
    words = TOPICS[n % min(providers, len(TOPICS))]
    return f"{words[n % len(words)]} {words[(n * 7 + 3) % len(words)]} query {n}"


def episodes(providers: list[str]) -> list:
    """Training episodes: each topic's queries labelled with its provider first, the last provider second."""
    sys.path.insert(0, str(ROOT))
    from tests.support.records import episode

    out = []
    for i, name in enumerate(providers[:len(TOPICS)]):
        words = TOPICS[i]
        for j in range(40):
            q = f"{words[j % len(words)]} {words[(j * 3 + 1) % len(words)]} study {j}"
            second = providers[-1] if name != providers[-1] else providers[0]
            out.append(episode(q, f"{name} > {second}", providers, f"bench-{name}-{j}", trace_id=f"bench-t-{name}{j}",
                               created_at=datetime(2026, 1, 1, tzinfo=UTC)))
    return out


def namespace(publisher_port: int) -> str:
    """The topic namespace of a routed run: the publisher's stamps are keyed by it, so the gateway shares it."""
    return f"benchrouted{publisher_port}."


def start_publisher(port: int, redis_url: str, kafka: str, storage: Path) -> subprocess.Popen:
    """The real publisher in its own process (stamps and the promoted key in ``redis_url``)."""
    env = {**os.environ, "FANROUTE_PORT": str(port), "FANROUTE_PUBLIC_URL": f"http://127.0.0.1:{port}",
           "FANROUTE_STORAGE_DIR": str(storage), "FANROUTE_REDIS__URL": redis_url,
           "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka, "FANROUTE_KAFKA__TOPIC_NAMESPACE": namespace(port),
           "FANROUTE_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "services.publisher"], cwd=ROOT, env=env)


def publish_and_promote(publisher_url: str, providers: list[str], fallback: str) -> str:
    """Fit the linear router on :func:`episodes`, publish and promote it; returns its served name."""
    sys.path.insert(0, str(ROOT))
    from services.common.publisher_client import PublisherClient
    from services.router.linear import fit, write_artifact

    router = fit(episodes(providers), seed=0)
    with tempfile.TemporaryDirectory(prefix="fanroute-bench-linear-") as tmp:
        write_artifact(router, Path(tmp))
        with PublisherClient(publisher_url) as client:
            msg = client.publish(MODEL_ID, Path(tmp), "tfidf+logreg", {"train_episodes": float(router.train_episodes)})
            client.promote(MODEL_ID, int(msg["version"]), fallback_provider=fallback,
                           evidence={"bench": "gateway_overhead routed run"})
    return f"{MODEL_ID}@{msg['version']}"


def routed_env(publisher_url: str, redis_url: str, fanout_fraction: float) -> dict[str, str]:
    """The gateway's routed-mode settings: the linear kind, pulled from the publisher, in-process."""
    port = int(publisher_url.rsplit(":", 1)[1])
    return {"FANROUTE_KAFKA__TOPIC_NAMESPACE": namespace(port), "FANROUTE_ROUTING__ENABLED": "true", "FANROUTE_ROUTING__KIND": "linear",
            "FANROUTE_ROUTING__PUBLISHER_URL": publisher_url, "FANROUTE_REDIS__URL": redis_url,
            "FANROUTE_ROUTING__FANOUT_FRACTION": str(fanout_fraction), "FANROUTE_ROUTING__MODEL_ID": MODEL_ID}


def redis_for(choice: str) -> str:
    """``auto``: $REDIS_URL, else the project's local stack's redis-server (started if not running)."""
    if choice != "auto":
        return choice
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    sys.path.insert(0, str(ROOT))
    import devstack

    url = devstack.up(components=("redis",)).redis_url
    assert url is not None
    return url


@contextlib.contextmanager
def local_stack_left_as_found(*, keep: bool = False) -> Iterator[None]:
    """Stop the project's local stack (``python -m devstack``) on the way out if it was not running on the
    way in, so a benchmark that needed it (``redis_for``, ``--kafka`` auto) leaves none behind; ``keep``
    (or a stack that was already up) leaves it running."""
    sys.path.insert(0, str(ROOT))
    import devstack

    before = devstack.status()
    was_up = any(before[c]["running"] for c in devstack.COMPONENTS)
    try:
        yield
    finally:
        if not keep and not was_up and any(devstack.status()[c]["running"] for c in devstack.COMPONENTS):
            print("stopping the local stack this benchmark started (--keep-stack leaves it)", file=sys.stderr)
            devstack.down()
