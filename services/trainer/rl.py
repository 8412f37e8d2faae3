"""Run kind ``rl``: LoRA policy-gradient steps on the rollout runner's groups of replay tasks, publishing each step.

Why this shape: the sampler, relay and sandboxes are other processes; the trainer only feeds tasks on
``tasks`` and takes finished groups from ``rollouts`` (:mod:`services.trainer.rl_data`). Per step it
takes the first ``groups_per_batch`` fresh groups, requeues stale ones (more than
``max_steps_off_policy`` steps behind: their task is published again), packs the non-uniform groups'
datums (the relay's tokens, the sampler's logprobs, advantage = reward - group mean), runs one step of
the chosen loss (:mod:`services.trainer.policy`) and publishes the adapter, so the runner's next groups
are stamped with it. ``(max_steps_off_policy + 1) x groups_per_batch`` tasks are kept in flight;
``max_steps_off_policy: 0`` is the synchronous loop. With ``resample_uniform: N`` up to N uniform groups
a step are set aside (counted) and the next tasks rolled out in their place (DAPO's dynamic sampling:
more prompts, not the same one again), so the batch fills with groups that have something to learn.
``test/`` rolls out the held-out tasks once each.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas.rollout import RolloutGroup
from schemas.task import Task
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import BusError, ConfigError
from services.models.prepare import resolve_base
from services.trainer import checkpoint as ckpt
from services.trainer.opsd import SamplerWeights
from services.trainer.policy import Accumulator, completion_logprobs, padded
from services.trainer.rl_data import (
    Feeder,
    bucket,
    load_tasks,
    pack,
    task_query,
    reward_stats,
    split_tasks,
    steps_behind,
    triage,
)
from services.trainer.settings import RlRun, TrainerSettings
from services.trainer.train import (
    DivergedError,
    MetricsLog,
    Out,
    Plan,
    Publisher,
    RunResult,
    _print,
    _save_adapter,
    inherited_rates,
    build_model,
    build_optimizer,
    publisher_for,
)

UNIFORM = "every group uniform, nothing to train on"


class RolloutsTimeout(BusError, TimeoutError):
    """The groups a batch waits for did not come back in time (is the rollout runner consuming ``tasks``?)."""


def plan_rl(s: TrainerSettings, tasks: Sequence[Task] | None, eval_tasks: Sequence[Task] | None = None) -> Plan:
    """Tasks, their eval split and the run's shape, without weights (``--dry-run`` prints this).

    ``eval_tasks`` (or ``eval_tasks_dir``): the held-out tasks, given apart; otherwise a hashed split."""
    run = s.run
    assert isinstance(run, RlRun)
    if tasks is None:
        if run.tasks_dir is None:
            raise ConfigError("run kind rl needs tasks_dir (the replay tasks it feeds to the rollout runner)")
        tasks = load_tasks(run.tasks_dir, contested_only=run.contested_only, limit=run.max_tasks)
    if eval_tasks is None and run.eval_tasks_dir is not None:
        eval_tasks = load_tasks(run.eval_tasks_dir)
    if eval_tasks is not None:
        train, held = list(tasks), list(eval_tasks)
        overlap = sorted(({t.trace_id for t in train} & {t.trace_id for t in held})
                         | ({task_query(t) for t in train} & {task_query(t) for t in held}))
        if overlap:
            raise ConfigError(f"{len(overlap)} held-out tasks share a trace or query with a training task (first: "
                              f"{overlap[0][:60]!r}): the eval would not be held out")
        if not train:
            raise ConfigError("no training task left")
    else:
        train, held = split_tasks(tasks, s.eval_fraction)
    base_dir = resolve_base(s.base_model, prepare=not s.dry_run)
    counts = {"tasks": len(tasks), "train_tasks": len(train), "eval_tasks": min(len(held), s.eval_max_examples),
              "groups_per_batch": run.groups_per_batch, "max_steps_off_policy": run.max_steps_off_policy,
              "in_flight": (run.max_steps_off_policy + 1) * run.groups_per_batch,
              "epochs": s.max_steps * run.groups_per_batch / len(train)}
    plan = Plan(s, str(run.tasks_dir or "given tasks"), counts, [], [], [], base_dir,
                batches=[[] for _ in range(s.max_steps)])
    plan.examples = [*train, *held[:s.eval_max_examples]]  # type: ignore[list-item]
    return plan


def _fingerprint(s: TrainerSettings, tasks: Sequence[Task]) -> dict[str, Any]:
    keep = s.fingerprint_fields()
    keep["run"].pop("batch_timeout_s", None)
    keep["run"].pop("micro_batch_rows", None)  # memory, not maths: a resume may change it
    data = hashlib.sha256("\n".join(t.task_id for t in tasks).encode()).hexdigest()[:24]
    return json.loads(json.dumps(keep | {"data": data}))


class RlLoop:
    """One run's state: the bus, the feeder, the model and what every step reports."""

    def __init__(self, s: TrainerSettings, plan: Plan, train: list[Task], held: list[Task], publisher: Publisher,
                 out: Out) -> None:
        run = s.run
        assert isinstance(run, RlRun)
        self.s, self.run, self.plan, self.held, self.out = s, run, plan, held, out
        self.feeder = Feeder(s.publish_id, train, s.seed)
        self.groups: asyncio.Queue[RolloutGroup] = asyncio.Queue()
        self.bus = Bus(s.kafka, client_id="fanroute-trainer-rl")
        self.publisher = publisher
        self.step_of: dict[int, int] = {}
        self.requeues_total = self.foreign = self.resampled = self.duplicates = 0
        self.rows_max = 0

    async def on_group(self, group: RolloutGroup) -> None:
        await self.groups.put(group)

    async def send(self, task: Task, kind: str = "train") -> None:
        self.feeder.sent(task, kind)
        await self.bus.publish(topic("tasks"), task)

    async def top_up(self, taken: int) -> None:
        """Keep ``(max_steps_off_policy + 1) x groups_per_batch`` training tasks with the runner, counting the
        ``taken`` groups of the batch being filled (so the synchronous loop sends exactly one batch's tasks)."""
        want = (self.run.max_steps_off_policy + 1) * self.run.groups_per_batch - taken
        have = sum(kind == "train" for q in self.feeder.out.values() for _, kind in q)
        for task in self.feeder.next_tasks(max(0, want - have)):
            await self.send(task)

    async def next_group(self, deadline: float, what: str) -> tuple[RolloutGroup, str]:
        """The next group of ours (claimed from the feeder) before ``deadline``; others are counted and skipped."""
        while True:
            left = deadline - time.monotonic()
            try:
                group = await asyncio.wait_for(self.groups.get(), max(left, 0.001))
            except TimeoutError:
                raise RolloutsTimeout(f"{what}: no group within {self.run.batch_timeout_s:.0f}s "
                                      f"({self.feeder.in_flight} tasks out); is the rollout runner consuming "
                                      "tasks?") from None
            kind = self.feeder.claim(group)
            if kind == "duplicate":  # a runner restarted between publish and mark ran its task again
                self.duplicates += 1
                self.out(f"dropped duplicate group {group.group_id} of task {group.task_id[:12]}")
                continue
            if kind is None:
                self.foreign += 1
                continue
            return group, kind

    async def batch(self, step: int) -> tuple[list[RolloutGroup], int, list[float]]:
        """The first ``groups_per_batch`` fresh groups for the weights after ``step - 1`` steps; requeues the stale."""
        deadline = time.monotonic() + self.run.batch_timeout_s
        taken: list[RolloutGroup] = []
        requeued, lags, self.resampled = 0, [], 0
        while len(taken) < self.run.groups_per_batch:
            await self.top_up(len(taken))
            group, kind = await self.next_group(deadline, f"step {step}")
            if kind != "train":
                continue
            if triage(group, step - 1, self.step_of, self.run.max_steps_off_policy) == "stale":
                requeued += 1
                await self.send(self.feeder.by_id[group.task_id])
                self.out(f"step {step}: requeued group {group.group_id} of task {group.task_id[:12]} "
                         f"(v{group.adapter_version}, {steps_behind(group, step - 1, self.step_of)} steps behind)")
                continue
            if group.uniform and self.resampled < self.run.resample_uniform:  # dynamic sampling (DAPO)
                # the next task takes the slot: a policy that answered this one alike twice mostly does again
                self.resampled += 1
                (task,) = self.feeder.next_tasks(1)  # the same task when it is the only one
                await self.send(task)
                instead = "its task is rolled out again" if task.task_id == group.task_id else \
                    f"task {task.task_id[:12]} is rolled out in its place"
                self.out(f"step {step}: uniform group {group.group_id} of task {group.task_id[:12]} "
                         f"(reward {group.rollouts[0].reward:.3f}); {instead}")
                continue
            lags.append(steps_behind(group, step - 1, self.step_of))
            taken.append(group)
        self.requeues_total += requeued
        return taken, requeued, lags

    async def evaluate(self, step: int) -> dict[str, float]:
        """Each held-out task rolled out once (a group each) under the current adapter: ``test/`` figures."""
        if not self.held:
            return {}
        for task in self.held:
            await self.send(task, "eval")
        deadline, got, other = time.monotonic() + self.run.batch_timeout_s, [], []
        while len(got) < len(self.held):
            group, kind = await self.next_group(deadline, f"eval at step {step}")
            (got if kind == "eval" else other).append(group)
        for g in other:  # training groups that came back meanwhile: answered again later
            self.feeder.sent(self.feeder.by_id[g.task_id], "train", g.started_at)
            await self.groups.put(g)
        return reward_stats(got, "test/reward") | {"test/uniform_groups": float(sum(g.uniform for g in got))}

    def train_step(self, model: Any, optimizer: Any, scheduler: Any, groups: list[RolloutGroup],
                   pad_id: int) -> dict[str, Any] | None:
        """One policy-gradient step on the batch's packed datums (None: no row to train on)."""
        s, run = self.s, self.run
        rows = pack(groups, s.max_tokens)
        if not rows.sequences:
            return None
        T = bucket(max(len(x) for x in rows.sequences), run.pack_multiple, s.max_tokens)
        C = bucket(max(len(x) - p for x, p in zip(rows.sequences, rows.starts)), run.pack_multiple, s.max_tokens)
        seqs, starts = list(rows.sequences), list(rows.starts)
        weights, lps, advs = list(rows.weights), list(rows.logprobs), list(rows.advantages)
        if run.fixed_shape:
            T = C = s.max_tokens
            self.rows_max = max(self.rows_max, len(seqs))
            for _ in range(self.rows_max - len(seqs)):  # zero-weight rows: same shape, no gradient
                seqs.append(seqs[0]), starts.append(starts[0])
                weights.append([0.0]), lps.append([0.0]), advs.append([0.0])
        model.eval()  # no dropout: the sampler computes without it, and the ratio must compare like with like
        spans = [min(len(x) - p, C) for x, p in zip(seqs, starts)]
        tokens = sum(float(sum(w[:n])) for w, n in zip(weights, spans))
        acc = Accumulator(run.loss, tokens, float(sum(any(w[:n]) for w, n in zip(weights, spans))),
                          clip_low=run.clip_low, clip_high=run.clip_high)
        M = run.micro_batch_rows
        for i in range(0, len(seqs), M):  # gradients accumulate; one optimizer step below
            trainer_lp_BC, entropy_BC, span_BC = completion_logprobs(model, seqs[i:i + M], starts[i:i + M], pad_id,
                                                                     length=T, width=C)
            mask_BC = padded(weights[i:i + M], C) * span_BC
            acc.add(trainer_lp_BC, padded(lps[i:i + M], C) * mask_BC, padded(advs[i:i + M], C) * mask_BC, mask_BC,
                    entropy_BC)
        stepped = acc.step(model, optimizer, scheduler, s.max_grad_norm)
        return stepped | {"rows": len(rows.sequences), "shape": [len(seqs), T, C], "tokens": rows.tokens,
                          "sampled_tokens": tokens, "micro_batches": -(-len(seqs) // M),
                          "truncated_rows": rows.truncated, "dropped_datums": rows.dropped}


async def train_rl_async(settings: TrainerSettings, *, tasks: Sequence[Task] | None = None,
                         eval_tasks: Sequence[Task] | None = None, publisher: Publisher | None = None,
                         out: Out = _print) -> RunResult:
    """Plan, then (unless dry-run) feed tasks, take groups, step and publish (see the module docstring)."""
    s, output_dir = settings, settings.output_dir
    plan = plan_rl(s, tasks, eval_tasks)
    if s.dry_run:
        out(json.dumps(plan.counts | {"config": s.model_dump(mode="json")}, indent=2, sort_keys=True, default=str))
        out("dry run: nothing trained")
        return RunResult(False, 0, output_dir, plan)
    publisher = publisher if publisher is not None else publisher_for(s)
    if publisher is None:
        raise ConfigError("run kind rl publishes after every step so the sampler serves it: set publisher_url")
    latest = ckpt.resumable(output_dir, s.resume)
    output_dir.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import AutoTokenizer

    if s.threads:
        torch.set_num_threads(s.threads)
    tokenizer = AutoTokenizer.from_pretrained(plan.base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = build_model(plan, out)
    optimizer, scheduler = build_optimizer(plan, model)
    n_train = plan.counts["train_tasks"]
    train, held = list(plan.examples[:n_train]), list(plan.examples[n_train:])  # type: ignore[arg-type]
    loop = RlLoop(s, plan, train, held, publisher, out)  # type: ignore[arg-type]
    fingerprint, start = _fingerprint(s, plan.examples), 0  # type: ignore[arg-type]
    if latest is not None:
        ckpt.check_fingerprint(ckpt.read_progress(latest).fingerprint, fingerprint, latest)
        progress = ckpt.load_checkpoint(latest, model, optimizer, scheduler)
        start, (loop.feeder.cursor, loop.requeues_total) = progress.step, progress.batches[0]
        if start >= s.max_steps:
            raise ConfigError(f"{latest} is at step {start}; max_steps={s.max_steps} leaves nothing to run")
        out(f"resumed from {latest} at step {start}")
    metrics = MetricsLog(output_dir / "metrics.jsonl", fresh=latest is None)
    header = plan.counts | {"config": s.model_dump(mode="json"), "base_model_dir": str(plan.base_dir)}
    (output_dir / "config.json").write_text(json.dumps(header, indent=2, sort_keys=True, default=str) + "\n")
    metrics.write(header | {"event": "start", "step": start, "resumed_from": start if latest else None})
    weights = SamplerWeights(s, None, publisher)  # type: ignore[arg-type]  # a publisher: no sampler call
    loop.bus.subscribe(topic("rollouts"), loop.on_group, group_id=f"trainer-rl.{s.publish_id}.{uuid.uuid4().hex[:8]}")
    await loop.bus.start((topic("tasks"), topic("rollouts")))
    final: dict[str, Any] = {}
    t_run = time.perf_counter()
    try:
        served, version = await asyncio.to_thread(weights.push, model, start, {"step": float(start)})
        loop.step_of[version] = start
        out(f"{n_train} training tasks, {len(held)} held out; {plan.counts['in_flight']} tasks in flight; "
            f"serving step {start} as {served}")

        async def run_eval(step: int) -> None:
            scores = await loop.evaluate(step)
            if scores:
                metrics.write({"step": step, **scores})
                final.update(scores if step else {f"start/{k}": v for k, v in scores.items()})
                out(f"eval step {step}: test/reward {scores['test/reward/mean']:.3f} (n={len(held)})")

        if start == 0:
            await run_eval(0)
        for step in range(start + 1, s.max_steps + 1):
            t0 = time.perf_counter()
            groups, requeued, lags = await loop.batch(step)
            t1 = time.perf_counter()
            rec: dict[str, Any] = reward_stats(groups) | {
                "step": step, "groups": len(groups), "uniform_groups": sum(g.uniform for g in groups),
                "requeues": requeued, "requeues_total": loop.requeues_total, "foreign_groups": loop.foreign,
                "duplicate_groups": loop.duplicates, "uniform_resampled": loop.resampled,
                "lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
                "sampled_versions": sorted({g.adapter_version for g in groups}), "wait_time_s": t1 - t0}
            stepped = await asyncio.to_thread(loop.train_step, model, optimizer, scheduler, groups, pad_id)
            t2 = time.perf_counter()
            if stepped is None:
                rec |= {"skipped": UNIFORM, "trained_version": version, "step_time_s": t2 - t0}
                metrics.write(rec)
                out(f"step {step}/{s.max_steps}: {UNIFORM} (reward {rec['reward/mean']:.3f})")
                continue
            rec |= stepped
            if not all(math.isfinite(rec[k]) for k in ("loss", "grad_norm")):
                metrics.write(rec)
                raise DivergedError(f"step {step}: loss {rec['loss']} / grad norm {rec['grad_norm']} is not finite; "
                                    f"stopped without publishing (metrics in {output_dir / 'metrics.jsonl'})")
            figures = {k: float(v) for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            served, version = await asyncio.to_thread(weights.push, model, step, figures)
            loop.step_of[version] = step
            rec |= {"trained_version": version, "train_time_s": t2 - t1, "publish_time_s": time.perf_counter() - t2,
                    "step_time_s": time.perf_counter() - t0}
            metrics.write(rec)
            final.update({f"train/{k}": v for k, v in rec.items() if k != "step"})
            out(f"step {step}/{s.max_steps} reward {rec['reward/mean']:.3f} (p50 {rec['reward/p50']:.2f}, uniform "
                f"{rec['uniform_groups']}/{len(groups)}) lag {rec['lag_mean']:.1f}/{rec['lag_max']:.0f} requeues "
                f"{requeued} mismatch {rec['mismatch']:.2e} entropy {rec['entropy']:.3f} grad_norm "
                f"{rec['grad_norm']:.3f} -> v{version} (wait {rec['wait_time_s']:.1f}s, train {rec['train_time_s']:.1f}s)")
            if ckpt.due(s.checkpoint_every, step, s.max_steps):
                ckpt.save_checkpoint(output_dir, model, optimizer, scheduler, ckpt.Progress(
                    step, [[loop.feeder.cursor, loop.requeues_total]], fingerprint), s.keep_checkpoints)
            if ckpt.due(s.eval_every, step, s.max_steps):
                await run_eval(step)
        ckpt.save_checkpoint(output_dir, model, optimizer, scheduler, ckpt.Progress(
            s.max_steps, [[loop.feeder.cursor, loop.requeues_total]], fingerprint), s.keep_checkpoints)
        await run_eval(s.max_steps)
    finally:
        with contextlib.suppress(Exception):
            await loop.bus.stop()
    adapter_dir = _save_adapter(model, output_dir / "adapter", inherited_rates(s.init_adapter))
    final |= {"steps": s.max_steps, "served": served, "version": version, "wall_time_s": time.perf_counter() - t_run,
              "requeues_total": loop.requeues_total}
    metrics.write({"event": "end", "step": s.max_steps, **final})
    published = {"model": served, "version": version}
    (output_dir / "summary.json").write_text(json.dumps(
        {"final": final, "adapter_dir": str(adapter_dir), "published": published}, indent=2, sort_keys=True,
        default=str) + "\n")
    out(f"done: {s.max_steps} steps, adapter at {adapter_dir}, last served as {served}")
    return RunResult(True, s.max_steps, Path(output_dir), plan, adapter_dir, final, published)


def train_rl(settings: TrainerSettings, **kw: Any) -> RunResult:
    """``fanroute train --kind rl``: :func:`train_rl_async` on its own event loop."""
    return asyncio.run(train_rl_async(settings, **kw))
