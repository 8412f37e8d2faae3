"""One cycle of the continual loop: dataset as of the slot → train from the deployed router → evaluate on
the held-out traces since the last cycle → promote if the rule says so.

Each phase ends with a record on the ``cycles`` topic (acks=all) before the next begins, so a loop
killed anywhere resumes the cycle under the same id from its last recorded phase: training is not
repeated once ``trained`` is recorded, and a promotion the publisher already holds is not asked again.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from schemas.cycle import CycleRecord, cycle_id, record_id
from schemas.episode import Episode
from schemas.topics import topic
from services.common.bus import Bus
from services.common.dataset import merge, write_jsonl
from services.common.paths import REPO_ROOT
from services.common.prompt import query_of
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic_records
from services.common.splits import normalise_query
from services.loop.history import Cycle, History
from services.loop.settings import LoopSettings
from services.router.policy import held_out

log = logging.getLogger(__name__)


def code_version() -> str:
    """``git describe`` of the checkout the loop runs from, else the package's version."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fanroute")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Dataset:
    """The cycle's training episodes (held-out queries removed) and how many are new since the last cycle."""

    train: list[Episode]
    total: int
    new: int
    held_out: int


async def dataset_for(settings: LoopSettings, slot: datetime, last_slot: datetime | None) -> Dataset:
    """The episodes topic as of ``slot`` (within the dataset window), merged by id; held-out queries dropped."""
    since = slot - timedelta(seconds=settings.dataset_window_s) if settings.dataset_window_s else None
    first_seen: dict[str, int] = {}
    episodes: dict[str, Episode] = {}
    async for rec in read_topic_records(settings.kafka, topic("episodes"), model=Episode, since=since,
                                        until=slot + timedelta(milliseconds=1)):
        ep = rec.message
        episodes[ep.episode_id] = merge(episodes[ep.episode_id], ep) if ep.episode_id in episodes else ep
        first_seen.setdefault(ep.episode_id, rec.timestamp_ms)
    cut = int(last_slot.timestamp() * 1000) if last_slot else None
    new = sum(1 for ms in first_seen.values() if cut is None or ms > cut)
    train = [episodes[k] for k in sorted(episodes)
             if not held_out(normalise_query(query_of(episodes[k])), settings.held_out_fraction)]
    return Dataset(train, len(episodes), new, len(episodes) - len(train))


class CycleRunner:
    """Runs (or resumes) cycles, writing each phase to the ``cycles`` topic."""

    def __init__(self, settings: LoopSettings, bus: Bus, judge_settings: Any = None) -> None:
        self.settings = settings
        self.bus = bus
        self.judge_settings = judge_settings
        self.version = code_version()

    def publisher(self) -> PublisherClient:
        return PublisherClient(self.settings.publisher_url, timeout_s=120)

    async def _write(self, cycle: Cycle, phase: str, trigger: str, timings: dict[str, float],
                     **fields: Any) -> CycleRecord:
        base = cycle.phases.get("started")
        carried = {k: getattr(base, k) for k in ("episodes", "new_episodes", "adapter_in", "drift")} if base else {}
        for earlier in ("trained", "evaluated"):
            if (r := cycle.phases.get(earlier)) is not None:
                carried.update(adapter_out=r.adapter_out, figures=r.figures, decision=r.decision, reasons=r.reasons)
        record = CycleRecord(record_id=record_id(cycle.cycle_id, phase), cycle_id=cycle.cycle_id, phase=phase,
                             at=datetime.now(UTC), model_id=self.settings.model_id, kind=self.settings.kind,
                             slot=cycle.slot, trigger=trigger, code_version=self.version,
                             timings_s=dict(timings), **{**carried, **fields})
        await self.bus.publish(topic("cycles"), record)
        cycle.phases.setdefault(phase, record)
        log.info("cycle %s (%s): %s", cycle.cycle_id, cycle.slot.isoformat(), phase)
        await self._hold(phase)
        return record

    async def _hold(self, point: str) -> None:
        """The fault-injection hook: stop here until killed (``FANROUTE_HOLD_AFTER``)."""
        if self.settings.hold_after == point:
            log.warning("holding after %s (FANROUTE_HOLD_AFTER) until killed", point)
            print(f"holding after {point}", flush=True)
            await asyncio.Event().wait()

    async def run(self, history: History, slot: datetime, trigger: str, drift=None) -> CycleRecord:
        """Run the cycle of ``slot`` (resuming it where the topic says it stopped); returns its last record.

        Input that cannot train or evaluate (too few labels, no held-out trace in the window) ends the cycle
        ``failed`` with the reason; anything else (an outage) leaves it unfinished, to be resumed."""
        from services.evaluate.inputs import EvalInputError
        from services.router.linear import LinearRouterError

        try:
            return await self._run(history, slot, trigger, drift)
        except (EvalInputError, LinearRouterError) as exc:
            cycle = history.find(cycle_id(self.settings.model_id, self.settings.kind, slot))
            assert cycle is not None
            timings = dict(cycle.last.timings_s) if cycle.phases else {}
            return await self._write(cycle, "failed", trigger, timings, reason=f"{type(exc).__name__}: {exc}"[:2000])

    async def _run(self, history: History, slot: datetime, trigger: str, drift) -> CycleRecord:
        s = self.settings
        cid = cycle_id(s.model_id, s.kind, slot)
        cycle = history.find(cid)
        if cycle is None:
            cycle = Cycle(cid, slot)
            history.cycles.append(cycle)
        if cycle.ended:
            return cycle.last
        start = cycle.get("started")
        trigger = start.trigger if start else trigger
        timings = dict(cycle.last.timings_s) if cycle.phases else {}
        previous = next((c for c in reversed(history.cycles) if c is not cycle and c.get("trained")), None)
        t0 = time.perf_counter()
        data = await dataset_for(s, slot, previous.slot if previous else None)
        deployed = await asyncio.to_thread(self._deployed)
        timings["dataset"] = round(time.perf_counter() - t0, 3)
        if start is None:
            await self._write(cycle, "started", trigger, timings, episodes=len(data.train), new_episodes=data.new,
                              adapter_in=deployed, drift=drift)
        if cycle.get("trained") is None and data.new < s.min_new_episodes:
            return await self._write(cycle, "skipped", trigger, timings,
                                     reason=f"{data.new} new episodes since the last cycle; at least "
                                            f"{s.min_new_episodes} are needed (min_new_episodes)")
        work = s.work_dir / cid
        train_file = write_jsonl(data.train, work / "train" / "episodes.jsonl")
        if (trained := cycle.get("trained")) is None:
            t0 = time.perf_counter()
            candidate = await asyncio.to_thread(self._train, train_file, work, deployed)
            timings["train"] = round(time.perf_counter() - t0, 3)
            trained = await self._write(cycle, "trained", trigger, timings, adapter_out=candidate)
        candidate = trained.adapter_out
        assert candidate is not None
        if (evaluated := cycle.get("evaluated")) is None:
            t0 = time.perf_counter()
            figures, decision, reasons = await self._evaluate(train_file, work, candidate, previous, slot)
            timings["eval"] = round(time.perf_counter() - t0, 3)
            evaluated = await self._write(cycle, "evaluated", trigger, timings, figures=figures, decision=decision,
                                          reasons=reasons)
        if evaluated.decision == "promote" and cycle.get("promoted") is None:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._promote, candidate, work)
            timings["promote"] = round(time.perf_counter() - t0, 3)
            await self._hold("promote_sent")
            await self._write(cycle, "promoted", trigger, timings)
        return await self._write(cycle, "finished", trigger, timings)

    def _deployed(self) -> str | None:
        with self.publisher() as client:
            record = client.promoted(self.settings.model_id)
        return f"{self.settings.model_id}@{record['version']}" if record else None

    def _train(self, train_file: Path, work: Path, deployed: str | None) -> str:
        """Fit/train the candidate on ``train_file`` and publish it; returns its served name."""
        s = self.settings
        if s.kind == "linear":
            from services.router.linear import fit, write_artifact
            from services.trainer.data import load_episodes_file

            router = fit(load_episodes_file(train_file), seed=0)
            out = work / "linear"
            write_artifact(router, out)
            metrics = {k: v for k, v in {"cv_accuracy": router.cv_accuracy,
                                         "train_episodes": float(router.train_episodes)}.items() if v == v}
            with self.publisher() as client:
                msg = client.publish(s.model_id, out, "tfidf+logreg", metrics)
            return f"{msg['model_id']}@{msg['version']}"
        from services.trainer import launch
        from services.trainer.settings import TrainerSettings

        init = None
        if deployed is not None:  # each cycle continues the deployed adapter
            version = int(deployed.rsplit("@", 1)[1])
            with self.publisher() as client:
                init = client.fetch_version(s.model_id, version, work / "deployed")
        settings = TrainerSettings(kafka=s.kafka, redis=s.redis, episodes_file=train_file, init_adapter=init,
                                   allow_uncalibrated=s.allow_uncalibrated, output_dir=work / "train" / "run",
                                   max_steps=s.max_steps, batch_size=s.batch_size, eval_fraction=0.1, eval_every=0,
                                   eval_max_examples=40, checkpoint_every=0, publisher_url=s.publisher_url,
                                   model_id=s.model_id)
        result = launch.train_in_process(settings)
        return f"{s.model_id}@{result['published']['version']}"

    async def _evaluate(self, train_file: Path, work: Path, candidate: str, previous: Cycle | None, slot: datetime):
        """``fanroute eval`` on the fan-out traces appended since the last cycle's slot and before this one's
        (their queries not trained on), then the promotion rule (pure)."""
        from services.evaluate.promote import decide, write_decision
        from services.evaluate.report import write_json
        from services.evaluate.run import EvalOptions, run_eval
        from services.judge.settings import JudgeSettings

        s = self.settings
        from services.common.settings import RedisSettings

        judge = self.judge_settings or JudgeSettings(kafka=s.kafka, redis=RedisSettings(url="memory://"))
        opts = EvalOptions(train_episodes=train_file, candidate=candidate, deployed="auto",
                           publisher_url=s.publisher_url, router_url=s.router_url, router_kind=s.kind,
                           since=previous.slot if previous else None, until=slot, router_mode=s.router_mode,
                           router_timeout_s=s.router_timeout_s, router_max_tokens=s.router_max_tokens,
                           resamples=s.bootstrap, progress=False)
        report = await run_eval(opts, judge)
        eval_dir = work / "eval"
        write_json(report, eval_dir)
        d = decide(report, eval_file=str(eval_dir / "eval.json"), max_router_p99_ms=s.max_router_p99_ms)
        write_decision(d, eval_dir)
        return figures_of(report), d.decision, tuple(d.reasons)

    def _promote(self, candidate: str, work: Path) -> None:
        """Promote ``candidate`` unless the publisher already has it promoted (a resumed cycle)."""
        from services.evaluate.promote import Decision, evidence
        from services.evaluate.report import read_report

        model_id, version = candidate.rsplit("@", 1)
        with self.publisher() as client:
            record = client.promoted(model_id)
            if record is not None and int(record["version"]) == int(version):
                log.info("%s is already promoted (a resumed cycle): not promoted again", candidate)
                return
            report = read_report(work / "eval" / "eval.json")
            decision = Decision.model_validate_json((work / "eval" / "decision.json").read_text())
            client.promote(model_id, int(version), fallback_provider=report.inputs.best_single.provider,
                           evidence=evidence(report, decision))


def figures_of(report) -> dict[str, float]:
    """The cycle record's figures: each policy's held-out means and cost, and the candidate's provider shares."""
    from collections import Counter

    from services.evaluate.policies import CANDIDATE

    out: dict[str, float] = {"held_out": float(report.inputs.held_out),
                             "human_queries": float(report.inputs.human_queries)}
    for name, p in report.policies.items():
        for measure in ("human", "judge"):
            if (m := getattr(p, measure).mean) is not None:
                out[f"{name}/{measure}"] = round(m, 4)
        out[f"{name}/cost"] = round(p.cost_per_query_usd, 6)
    picks = Counter(row.outcomes[CANDIDATE].returned for row in report.queries if CANDIDATE in row.outcomes)
    total = sum(picks.values())
    for provider, n in picks.items():
        if provider is not None and total:
            out[f"share/{provider}"] = round(n / total, 4)
    return out
