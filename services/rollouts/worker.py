"""The rollout runner: ``tasks`` (and ``adapters``) → groups of sandboxed rollouts → ``rollouts``.

Each task record starts one group (a task republished, e.g. by the trainer requeueing a stale group, runs
again: groups have their own ids, tasks are not deduplicated). The handler writes the task to the ledger
(:mod:`services.rollouts.ledger`, Redis) and queues it, so a long group never holds the consumer past
Kafka's poll interval; groups run in the background, ``max_parallel`` sandboxes at a time. Delivery: the
offset is committed once the ledger has the record (keyed by its place in the log); the key is marked done
when the group is on ``rollouts``; a starting runner first runs again what a killed one left pending (a new
group: new ids and relay episodes, since the dead run's episodes may hold calls), and a record redelivered
because the kill beat its commit is already in the ledger and not run twice: a kill loses nothing.
A group whose relay, Redis or Kafka calls keep failing is retried, then counted as failed and left in the
ledger for the next start; one that fails otherwise (a bug, a broken task) is counted and dropped.
``adapters`` is followed for the newest version (reported beside each group's stamp); the stamp itself is
read from Redis when a group starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
import logging
import signal

from schemas.adapter import AdapterPublished
from schemas.task import Task
from schemas.topics import topic
from services.common.bus import Bus, RecordRef
from services.common.errors import BusError, TransientError
from services.rollouts.group import GroupRunner, ceiling_report
from services.rollouts.ledger import Ledger, MemoryLedger
from services.rollouts.relay_client import RelayRefused
from services.rollouts.settings import RolloutSettings

log = logging.getLogger(__name__)
GROUP_ATTEMPTS = 3


class RolloutWorker:
    """Queues tasks, runs their groups, publishes each finished group."""

    def __init__(self, settings: RolloutSettings, bus: Bus, runner: GroupRunner, ledger: Ledger | None = None) -> None:
        self.settings, self.bus, self.runner = settings, bus, runner
        self.ledger = ledger or MemoryLedger()
        groups = max(1, -(-settings.max_parallel // settings.group_size)) + 1  # keep every slot busy, one ahead
        self.queue: asyncio.Queue[tuple[str, Task]] = asyncio.Queue(maxsize=groups * 4)
        self.workers = [asyncio.ensure_future(self._work()) for _ in range(groups)]
        self.latest_version = 0
        self.published = 0
        self.rebuild_ledger: Callable[[], Awaitable[object]] | None = None  # set by run() on a real broker
        self._rebuilding = asyncio.Lock()
        self.ledger_rebuilds = 0

    async def on_task(self, task: Task, record: RecordRef) -> None:
        """Ledger first (Redis down: a transient error, the record is retried, not committed), then the queue;
        a record the ledger already has (redelivered after a kill before its commit) is not run again."""
        await self.check_ledger()
        if await self.ledger.accept(record.key, task):
            await self.queue.put((record.key, task))
        else:
            log.info("task record %s already accepted (pending or done): not run again", record.key)

    async def check_ledger(self) -> None:
        """Rebuild the ledger from the topics first if Redis lost it (services/rollouts/ledger_rebuild.py)."""
        if self.rebuild_ledger is not None and not await self.ledger.intact():
            async with self._rebuilding:
                if not await self.ledger.intact():
                    await self.rebuild_ledger()
                    await self.ledger.arm()
                    self.ledger_rebuilds += 1

    async def resume(self, left: list[tuple[str, Task]]) -> None:
        """Queue the groups a previous run accepted and did not publish (read before consuming starts)."""
        for entry, task in left:
            log.warning("resuming task record %s (task %s): accepted by a previous run, never published", entry,
                        task.task_id[:12])
            await self.queue.put((entry, task))

    async def on_adapter(self, adapter: AdapterPublished) -> None:
        if adapter.model_id == self.settings.model_id and adapter.version > self.latest_version:
            self.latest_version = adapter.version
            self.runner.metrics.latest.set(adapter.version)

    async def _work(self) -> None:
        while True:
            entry, task = await self.queue.get()
            try:
                await self.run_task(task, entry)
            finally:
                self.queue.task_done()

    async def run_task(self, task: Task, entry: str | None = None) -> None:
        """One group of ``task``, published, its ledger ``entry`` removed; transient failures retried, then
        counted as failed (left in the ledger for the next start)."""
        for attempt in range(1, GROUP_ATTEMPTS + 1):
            try:
                group = await self.runner.run_group(task, group_id_of(entry) if entry is not None else None)
                await self.bus.publish(topic("rollouts"), group)
                if entry is not None:
                    await self._forget(entry)
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
                if entry is not None:
                    await self._forget(entry)
                break
        self.runner.metrics.failed.inc()

    async def _forget(self, entry: str) -> None:
        """Mark ``entry`` done in the ledger; a failure only means the next start runs it again (logged)."""
        try:
            await self.ledger.done(entry)
        except (TransientError, OSError) as exc:
            log.warning("ledger entry %s not marked done (%s): a restart would run that group again", entry, exc)

    async def close(self) -> None:
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)


def group_id_of(entry: str) -> str:
    """The group id of a task record's group, from the record (its ledger entry): a runner killed after
    publishing a group and before marking it done runs the task again on restart, and that second group
    carries the same id, which the trainer drops as a duplicate."""
    return "g-" + hashlib.sha256(entry.encode()).hexdigest()[:24]


async def run(settings: RolloutSettings, stop: asyncio.Event | None = None) -> None:
    """Consume until ``stop`` is set (or SIGTERM/SIGINT)."""
    from prometheus_client import start_http_server

    from services.common.stamps import stamp_store
    from services.rollouts.ledger import ledger
    from services.rollouts.ledger_rebuild import rebuild_ledger
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
    pending = ledger(settings.redis.url, settings.kafka.topic_namespace, settings.group_id)
    bus = Bus(settings.kafka, client_id="fanroute-rollouts")
    async with RelayAdmin(settings.relay_url, admin_token, settings.relay_timeout_s) as admin:
        runner = GroupRunner(settings, sandbox, admin, stamps)
        worker = RolloutWorker(settings, bus, runner, pending)
        bus.subscribe(topic("tasks"), worker.on_task, group_id=f"{settings.group_id}.tasks", with_record=True)
        bus.subscribe(topic("adapters"), worker.on_adapter, group_id=f"{settings.group_id}.adapters")
        if settings.metrics_port:
            start_http_server(settings.metrics_port, registry=runner.metrics.registry)
        if not bus.in_memory:
            worker.rebuild_ledger = lambda: rebuild_ledger(settings.kafka, pending, f"{settings.group_id}.tasks",
                                                           group_id_of)
            await worker.check_ledger()  # a Redis that came back empty while the runner was down
        left = await pending.pending()  # before consuming: only what earlier runs accepted
        await bus.start(tuple(topic(n) for n in ("tasks", "adapters", "rollouts")))
        resuming = asyncio.ensure_future(worker.resume(left))
        log.info("rollout runner: %s sandbox, harness %s, group_size %d; %s", sandbox.kind, settings.harness.name,
                 settings.group_size, ceiling_report(settings))
        try:
            await stop.wait()
        finally:
            resuming.cancel()
            await bus.stop()
            await worker.close()
            await stamps.close()
            await pending.close()
