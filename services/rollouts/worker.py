"""The rollout runner: ``tasks`` (and ``adapters``) → groups of sandboxed rollouts → ``rollouts``.

Each task record starts one group (a task republished, e.g. by the trainer requeueing a stale group, runs
again: groups have their own ids, tasks are not deduplicated). The handler only queues the task (bounded
by ``max_queued_tasks``), so a long group never holds the consumer past Kafka's poll interval; groups run
in the background, ``max_parallel`` sandboxes at a time. Delivery: a queued task's offset is committed, so
a runner killed mid-group loses that group (the task stays on the topic); a group whose relay, Redis or
Kafka calls keep failing is retried, then counted as failed. ``adapters`` is followed for the newest
version (reported beside each group's stamp); the stamp itself is read from Redis when a group starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from schemas.adapter import AdapterPublished
from schemas.task import Task
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import BusError, TransientError
from services.rollouts.group import GroupRunner, ceiling_report
from services.rollouts.relay_client import RelayRefused
from services.rollouts.settings import RolloutSettings

log = logging.getLogger(__name__)
GROUP_ATTEMPTS = 3


class RolloutWorker:
    """Queues tasks, runs their groups, publishes each finished group."""

    def __init__(self, settings: RolloutSettings, bus: Bus, runner: GroupRunner) -> None:
        self.settings, self.bus, self.runner = settings, bus, runner
        groups = max(1, -(-settings.max_parallel // settings.group_size)) + 1  # keep every slot busy, one ahead
        self.queue: asyncio.Queue[Task] = asyncio.Queue(maxsize=groups * 4)
        self.workers = [asyncio.ensure_future(self._work()) for _ in range(groups)]
        self.latest_version = 0
        self.published = 0

    async def on_task(self, task: Task) -> None:
        await self.queue.put(task)

    async def on_adapter(self, adapter: AdapterPublished) -> None:
        if adapter.model_id == self.settings.model_id and adapter.version > self.latest_version:
            self.latest_version = adapter.version
            self.runner.metrics.latest.set(adapter.version)

    async def _work(self) -> None:
        while True:
            task = await self.queue.get()
            try:
                await self.run_task(task)
            finally:
                self.queue.task_done()

    async def run_task(self, task: Task) -> None:
        """One group of ``task``, published; transient failures retried, then counted as failed."""
        for attempt in range(1, GROUP_ATTEMPTS + 1):
            try:
                group = await self.runner.run_group(task)
                await self.bus.publish(topic("rollouts"), group)
                self.published += 1
                self.runner.metrics.groups.inc()
                behind = self.latest_version - group.adapter_version
                log.info("published group %s (%s@%d, %d behind the newest seen)", group.group_id, group.model_id,
                         group.adapter_version, max(behind, 0))
                return
            except (TransientError, BusError, RelayRefused) as exc:
                log.warning("group of task %s, attempt %d/%d: %s", task.task_id[:12], attempt, GROUP_ATTEMPTS, exc)
                if attempt < GROUP_ATTEMPTS:
                    await asyncio.sleep(min(2.0 ** attempt, 30.0))
            except Exception:
                log.exception("group of task %s failed", task.task_id[:12])
                break
        self.runner.metrics.failed.inc()

    async def close(self) -> None:
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)


async def run(settings: RolloutSettings, stop: asyncio.Event | None = None) -> None:
    """Consume until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from services.common.stamps import stamp_store
    from services.rollouts.relay_client import RelayAdmin
    from services.rollouts.sandbox import make_sandbox

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    sandbox = make_sandbox(settings.sandbox, settings.harness)
    stamps = stamp_store(settings.redis.url, settings.kafka.topic_namespace)
    admin_token = settings.admin_token.get_secret_value() if settings.admin_token else ""
    bus = Bus(settings.kafka, client_id="fanroute-rollouts")
    async with RelayAdmin(settings.relay_url, admin_token, settings.relay_timeout_s) as admin:
        runner = GroupRunner(settings, sandbox, admin, stamps)
        worker = RolloutWorker(settings, bus, runner)
        bus.subscribe(topic("tasks"), worker.on_task, group_id=f"{settings.group_id}.tasks")
        bus.subscribe(topic("adapters"), worker.on_adapter, group_id=f"{settings.group_id}.adapters")
        if settings.metrics_port:
            start_http_server(settings.metrics_port, registry=runner.metrics.registry)
        await bus.start(tuple(topic(n) for n in ("tasks", "adapters", "rollouts")))
        log.info("rollout runner: %s sandbox, harness %s, group_size %d; %s", sandbox.kind, settings.harness.name,
                 settings.group_size, ceiling_report(settings))
        try:
            await stop.wait()
        finally:
            await bus.stop()
            await worker.close()
            await stamps.close()
