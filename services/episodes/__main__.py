"""``python -m services.episodes``: parse settings, then join traces and verdicts into episodes."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.common.entry import service_main
from services.episodes.settings import EpisodeSettings

log = logging.getLogger("services.episodes")


async def run(settings: EpisodeSettings, stop: asyncio.Event | None = None) -> None:
    """Consume until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from schemas.topics import topic
    from services.common.bus import Bus, ensure_topics
    from services.common.idempotency import key_store
    from services.episodes.state import MemoryJoinStore, RedisJoinStore
    from services.episodes.worker import EpisodeBuilder

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ns = settings.kafka.topic_namespace
    prefix = f"fanroute:{ns}episodes:{settings.group_id}"
    state = (MemoryJoinStore() if settings.redis.url == "memory://"
             else RedisJoinStore(settings.redis.url, prefix, settings.trace_ttl_s))
    bus = Bus(settings.kafka, client_id="fanroute-episodes")
    builder = EpisodeBuilder(bus, state, key_store(settings.redis.url, prefix))
    # One group per topic: members of one group with different subscriptions confuse assignors.
    bus.subscribe(topic("traces"), builder.on_trace, group_id=f"{settings.group_id}.traces")
    bus.subscribe(topic("verdicts"), builder.on_verdict, group_id=f"{settings.group_id}.verdicts")
    specs = [topic(n) for n in ("traces", "verdicts", "episodes", "tasks")]
    if settings.kafka.ensure_topics and not bus.in_memory:
        await ensure_topics(settings.kafka, [(bus.name(s), s) for s in specs])
    found = await builder.reconcile(settings.kafka)  # before consuming (see EpisodeBuilder)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=builder.metrics.registry)
    await bus.start()
    log.info("episode builder consuming traces+verdicts as %s (%d episode components already out)",
             settings.group_id, found)
    try:
        await stop.wait()
    finally:
        await bus.stop()
        await state.close()
        await builder.done.close()


def main() -> int:
    return service_main("episodes", EpisodeSettings, run)


if __name__ == "__main__":
    sys.exit(main())
