"""The loop's schedule: one cycle per slot (every N seconds, or daily at HH:MM, UTC), an early cycle when the
fan-out slice drifts, an unfinished cycle resumed first, and a Redis lease so two replicas run a slot once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, time, timedelta

from schemas.cycle import CycleRecord
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import FanrouteError
from services.loop.cycle import CycleRunner
from services.loop.drift import measure_drift
from services.loop.history import History, read_history
from services.loop.lease import Lease, LeaseLost, lease_key
from services.loop.settings import LoopSettings

log = logging.getLogger(__name__)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def current_slot(settings: LoopSettings, now: datetime) -> datetime:
    """The latest scheduled time at or before ``now``: a multiple of ``every_s`` since the epoch, or today's
    (else yesterday's) ``at``."""
    if settings.at is not None:
        hh, mm = (int(x) for x in settings.at.split(":"))
        today = datetime.combine(now.date(), time(hh, mm), tzinfo=UTC)
        return today if today <= now else today - timedelta(days=1)
    n = int((now - EPOCH).total_seconds() // settings.every_s)
    return EPOCH + timedelta(seconds=n * settings.every_s)


def next_slot(settings: LoopSettings, now: datetime) -> datetime:
    """The first scheduled time after ``now``."""
    return current_slot(settings, now) + (timedelta(days=1) if settings.at else timedelta(seconds=settings.every_s))


class Loop:
    """The scheduler around :class:`CycleRunner`: lease, history, drift."""

    def __init__(self, settings: LoopSettings, judge_settings=None) -> None:
        self.settings = settings
        self.bus = Bus(settings.kafka, client_id="fanroute-loop")
        self.lease = Lease(settings.redis.url, lease_key(settings.kafka.topic_namespace, settings.model_id,
                                                         settings.kind), settings.lease_ttl_s)
        self.runner = CycleRunner(settings, self.bus, judge_settings)

    async def start(self) -> None:
        await self.bus.start((topic("cycles"),))

    async def stop(self) -> None:
        await self.bus.stop()
        await self.lease.close()

    async def history(self) -> History:
        return await read_history(self.settings.kafka, self.settings.model_id, self.settings.kind)

    async def drift(self, history: History, now: datetime):
        """Drift since the deployed router's cycle (before any promotion: since the last cycle that trained)."""
        reference = history.deployed() or history.last_ran()
        return await measure_drift(self.settings.kafka, reference.slot if reference else None,
                                   self.settings.dataset_window_s, threshold=self.settings.drift_threshold,
                                   min_n=self.settings.drift_min_verdicts, now=now)

    async def run_slot(self, slot: datetime, trigger: str) -> CycleRecord | None:
        """Run (or resume, or find already run) the cycle of ``slot`` under the lease; None when another
        replica held the lease for longer than a cycle may take to notice."""
        async with self.lease.hold(wait_s=max(3 * self.settings.lease_ttl_s, 10.0)) as held:
            if not held:
                log.warning("slot %s: another loop replica holds the lease; not run here", slot.isoformat())
                return None
            history = await self.history()  # read under the lease: what another replica finished is seen
            drift = await self.drift(history, slot)
            cycle = asyncio.create_task(self.runner.run(history, slot, trigger, drift))
            lost = asyncio.create_task(self.lease.lost.wait())
            try:
                await asyncio.wait({cycle, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
            if not cycle.done():
                cycle.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await cycle
                raise LeaseLost(f"slot {slot.isoformat()}: the lease was lost mid-cycle; the cycle resumes where "
                                "its last phase record left it, on whichever replica holds the lease next")
            return cycle.result()

    async def once(self, slot: datetime | None = None) -> CycleRecord | None:
        """Finish a cycle left unfinished, then run the given (default: the current) slot's cycle."""
        history = await self.history()
        if (left := history.unfinished()) is not None and (slot is None or left.slot != slot):
            log.info("resuming cycle %s of slot %s first", left.cycle_id, left.slot.isoformat())
            await self.run_slot(left.slot, "once")
        return await self.run_slot(slot or current_slot(self.settings, datetime.now(UTC)), "once")

    async def forever(self) -> None:
        """Cycle at every slot; between slots, check drift and run one early cycle per interval when it triggers."""
        s = self.settings
        while True:
            history = await self.history()
            if (left := history.unfinished()) is not None:
                await self._guarded(left.slot, "schedule")
            now = datetime.now(UTC)
            slot = current_slot(s, now)
            done = history.find(self.runner_cycle_id(slot))
            if done is None or not done.ended:
                await self._guarded(slot, "schedule")
            early_done = False
            nxt = next_slot(s, datetime.now(UTC))
            while (now := datetime.now(UTC)) < nxt:
                await asyncio.sleep(min(s.drift_check_s, (nxt - now).total_seconds()))  # a timer, not a sync wait
                if early_done or datetime.now(UTC) >= nxt:
                    continue
                drift = await self.drift(await self.history(), datetime.now(UTC))
                if drift.triggered:
                    log.warning("drift %.3f >= %.3f (worst: %s): running a cycle early", drift.score or 0,
                                drift.threshold, drift.worst)
                    await self._guarded(datetime.now(UTC).replace(microsecond=0), "drift")
                    early_done = True

    def runner_cycle_id(self, slot: datetime) -> str:
        from schemas.cycle import cycle_id

        return cycle_id(self.settings.model_id, self.settings.kind, slot)

    async def _guarded(self, slot: datetime, trigger: str) -> None:
        """A cycle whose failure is logged and left unfinished (resumed at the next tick), never fatal here."""
        try:
            record = await self.run_slot(slot, trigger)
            if record is not None:
                print(render(record), flush=True)
        except asyncio.CancelledError:
            raise
        except (FanrouteError, OSError) as exc:
            log.error("cycle of slot %s did not finish: %s (it resumes at the next tick)", slot.isoformat(), exc)


def render(record: CycleRecord) -> str:
    """One line per cycle: slot, phase, adapters, decision, the candidate's held-out nDCG and the drift score."""
    f = record.figures
    human = f.get("candidate/human")
    drift = record.drift.score if record.drift is not None else None
    parts = [f"cycle {record.cycle_id} slot {record.slot.isoformat()} ({record.trigger}): {record.phase}",
             f"episodes {record.episodes} (+{record.new_episodes})",
             f"adapter {record.adapter_in or '-'} -> {record.adapter_out or '-'}"]
    if human is not None:
        parts.append(f"held-out nDCG@10 {human:.3f}")
    if record.decision:
        parts.append(record.decision)
    if drift is not None:
        parts.append(f"drift {drift:.3f}")
    if record.reason:
        parts.append(record.reason)
    return "; ".join(parts)


async def run(settings: LoopSettings, slot: datetime | None = None) -> int:
    """``fanroute loop``: one cycle (``once``) or the schedule; the exit status of ``once`` says how it ended.

    SIGTERM or SIGINT stops it cleanly: the cycle in flight is cancelled (it resumes from its last phase
    record on the next start), the lease is given back, and the schedule exits 0."""
    import signal

    loop = Loop(settings)
    await loop.start()
    work = asyncio.current_task()
    assert work is not None
    stopping = False

    def stop() -> None:
        nonlocal stopping
        stopping = True
        work.cancel()

    events = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        events.add_signal_handler(sig, stop)
    try:
        if not settings.once:
            await loop.forever()
            return 0
        record = await loop.once(slot)
        if record is None:
            print("another loop replica holds the lease; nothing run here", flush=True)
            return 0
        print(render(record), flush=True)
        return 0 if record.phase in ("finished", "skipped") else 1
    except asyncio.CancelledError:
        if not stopping:
            raise
        work.uncancel()  # our own stop (a signal), not a cancellation from outside: exit cleanly
        print("stopped (a cycle in flight resumes from its last recorded phase)", flush=True)
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            events.remove_signal_handler(sig)
        await loop.stop()
