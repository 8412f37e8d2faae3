"""``python -m services.judge``: parse settings, refuse a judge that is a provider, then consume."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from urllib.parse import urlsplit

from services.common.entry import service_main
from services.judge.settings import JudgeSettings

log = logging.getLogger("services.judge")


def guard(settings: JudgeSettings) -> None:
    """Refuse (ConfigError) when the configured judge is one of the judged providers: by name or
    endpoint (any judge), or by sharing a dense provider's embedding model (local judge)."""
    from services.common.errors import ConfigError
    from services.judge.guard import check_not_a_provider
    from services.judge.settings import build_backend
    from services.judge.settings_local import LocalJudgeConfig

    check_not_a_provider(build_backend(settings.judge).identity, settings.providers)
    if isinstance(settings.judge, LocalJudgeConfig) and settings.judge.use_embeddings:
        from services.judge.backends.local import conflicting_providers

        clash = conflicting_providers(settings.judge, settings.providers)
        if clash:
            raise ConfigError(f"the local judge embeds with the same model as provider(s) {clash}; "
                              "it would flatter them — use the lexical local judge "
                              "(FANROUTE_JUDGE='{\"type\": \"local\"}') or another judge")


def provider_hosts(settings: JudgeSettings) -> tuple[str, ...]:
    """Hosts of web providers' endpoints: scrubbed from anything the judge reads."""
    hosts = (urlsplit(getattr(p, "base_url", "") or "").hostname for p in settings.providers)
    return tuple(h for h in hosts if h)


async def run(settings: JudgeSettings, stop: asyncio.Event | None = None) -> None:
    """Consume traces until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from schemas.topics import topic
    from services.common.bus import Bus
    from services.common.idempotency import key_store
    from services.judge.settings import build_backend
    from services.judge.worker import JudgeWorker, judge_key

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backend = build_backend(settings.judge)
    await backend.start()
    bus = Bus(settings.kafka, client_id="fanroute-judge")
    key = judge_key(backend, backend.rubric)
    prefix = f"fanroute:{settings.kafka.topic_namespace}judge:{key}"  # namespaced like the topics
    worker = JudgeWorker(bus, backend, key_store(settings.redis.url, prefix),
                         sample_rate=settings.sample_rate, hide=provider_hosts(settings))
    bus.subscribe(topic("traces"), worker.handle, group_id=f"{settings.group_prefix}.{worker.key}")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=worker.metrics.registry)
    from services.common.bus import ensure_topics

    if settings.kafka.ensure_topics:
        await ensure_topics(settings.kafka, [(bus.name(s), s) for s in (topic("traces"), topic("verdicts"))])
    found = await worker.reconcile(settings.kafka)  # before consuming: see JudgeWorker.reconcile
    await bus.start()
    log.info("reconciled %d verdicts already on the topic", found)
    log.info("judge %s (%s) consuming traces as group %s.%s", backend.identity.model,
             backend.identity.kind, settings.group_prefix, worker.key)
    try:
        await stop.wait()
    finally:
        await bus.stop()
        await worker.store.close()
        await backend.close()


def main() -> int:
    def load() -> JudgeSettings:
        settings = JudgeSettings()
        guard(settings)
        return settings

    return service_main("judge", load, run, refusal="refusing to start")


if __name__ == "__main__":
    sys.exit(main())
