"""``fanroute rl smoke|overfit|preflight``: the guide's de-risking runs on one machine, every service in process.

Why a composing command: the RL loop needs the publisher, the CPU sampler (pulling each published adapter),
the relay in front of it, the rollout runner (bubblewrap sandboxes) and the trainer's ``rl`` run kind, all
on one Kafka and Redis; these recipes start them with the sizes the guide names and write what they saw.

- ``preflight``: every task once with the untrained policy (no training); the non-model error rate
  (sandbox failures, grader crashes, harness timeouts and crashes) must be 0;
- ``smoke``: one group of two, one step, synchronous; its wall time. A uniform group (both rollouts scored
  alike) is set aside and the next of up to 16 contested tasks rolled out in its place, so the one step
  has something to train on (the demo's SFT adapter answered 11 tasks in a row alike twice); the base
  model without an adapter never writes an ordering (every group scores 0): start it from an SFT adapter;
- ``overfit``: 32 contested tasks, group size 8, synchronous, every step an epoch; training reward per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import topic
from schemas.rollout import RolloutGroup
from schemas.task import Task
from services.common.bus import Bus
from services.common.rewards import DEFAULT_COST_WEIGHT
from services.common.settings import KafkaSettings, RedisSettings
from services.tools.serving import free_port, served

NON_MODEL = ("sandbox_failed", "grader_crashed", "timed_out", "harness_crashed")
ADMIN = "rl-recipe-admin"


@dataclass(frozen=True)
class Recipe:
    """One recipe's sizes."""

    tasks: int
    group_size: int
    groups_per_batch: int
    steps: int
    max_tokens: int = 48
    lr: float = 5e-4
    max_parallel: int = 4
    resample_uniform: int = 0
    reward: str = "ndcg"  # the runner's reward component (services/common/rewards.py)
    cost_weight: float = DEFAULT_COST_WEIGHT


RECIPES = {"smoke": Recipe(tasks=16, group_size=2, groups_per_batch=1, steps=1, resample_uniform=15),
           "overfit": Recipe(tasks=32, group_size=8, groups_per_batch=32, steps=5, max_tokens=24),
           "preflight": Recipe(tasks=0, group_size=1, groups_per_batch=1, steps=0)}


@contextlib.asynccontextmanager
async def stack(kafka: KafkaSettings, redis: RedisSettings, work: Path, base: Path, recipe: Recipe, model_id: str,
                engine: str = "cpu", vllm_url: str | None = None):
    """Publisher, sampler (pulling adapters), relay and rollout runner on loopback; yields the publisher URL.
    ``engine="vllm"``: the real vLLM server generates (the one at ``vllm_url``, else one started here),
    and the sampler only loads each published adapter into it."""
    from services.publisher.app import create_app as publisher_app
    from services.publisher.settings import PublisherSettings
    from services.relay.app import create_app as relay_app
    from services.relay.settings import RelaySettings
    from services.rollouts import worker
    from services.rollouts.settings import RolloutSettings
    from services.sampler.app import create_app as sampler_app
    from services.sampler.settings import SamplerSettings

    pport, sport, rport = free_port(), free_port(), free_port()
    purl, ns = f"http://127.0.0.1:{pport}", kafka.topic_namespace
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as st:
        # the sandbox's relay socket lives under work_dir, and AF_UNIX paths stop at 107 bytes: keep it short
        sandboxes = Path(st.enter_context(tempfile.TemporaryDirectory(prefix="rl-", dir="/tmp")))
        await st.enter_async_context(served(publisher_app(PublisherSettings(
            kafka=kafka, redis=redis, port=pport, storage_dir=work / "store", public_url=purl)), pport,
            what="publisher", start_timeout_s=120))
        if engine != "vllm":
            vllm_url = None
        elif vllm_url is None:
            from services.tools.vllm import VllmServer, running

            vllm_url, _ = await st.enter_async_context(running(
                VllmServer(model=str(base), port=free_port(), max_lora_rank=64, max_loras=4),
                log_path=work / "vllm.log"))
        surl = await st.enter_async_context(served(sampler_app(SamplerSettings(
            kafka=kafka, redis=redis, port=sport, base_model=str(base), adapter_cache_dir=work / "cache",
            publisher_url=purl, group_id=f"sampler-rl-{uuid.uuid4().hex[:6]}", vllm_url=vllm_url)), sport,
            what="sampler", start_timeout_s=300))
        surl = vllm_url or surl
        relay = RelaySettings(kafka=kafka, redis=redis, port=rport, sampler_url=surl, tokenizer=str(base),
                              adapter_model_id=model_id, admin_token=ADMIN)
        rurl = await st.enter_async_context(served(relay_app(relay), rport, what="relay", start_timeout_s=120))
        runner = RolloutSettings(kafka=kafka, redis=redis, relay_url=rurl, admin_token=ADMIN, model_id=model_id,
                                 group_size=recipe.group_size, max_parallel=recipe.max_parallel,
                                 groups_per_batch=recipe.groups_per_batch, max_steps_off_policy=0,
                                 sandbox_timeout_s=300, command_timeout_s=240, work_dir=sandboxes,
                                 harness={"max_tokens": recipe.max_tokens}, reward=recipe.reward,
                                 cost_weight=recipe.cost_weight,
                                 group_id=f"rollouts-rl-{(ns or 'x').rstrip('.').lower()}-{uuid.uuid4().hex[:6]}")
        running = asyncio.create_task(worker.run(runner, stop))
        try:
            yield purl
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 60)


async def preflight(kafka: KafkaSettings, tasks: list[Task], timeout_s: float) -> dict[str, Any]:
    """Every task once through the running stack, no training: outcomes and the non-model error rate (a
    progress bar counts the groups back and the non-model errors so far)."""
    from tqdm import tqdm

    got: dict[str, RolloutGroup] = {}
    done = asyncio.Event()
    started = time.perf_counter()
    wanted = {t.task_id for t in tasks}
    bar = tqdm(total=len(wanted), desc="preflight", unit="task")
    errors_so_far = 0

    async def on_group(g: RolloutGroup) -> None:
        nonlocal errors_so_far
        if g.task_id in wanted and g.task_id not in got:
            got[g.task_id] = g
            errors_so_far += sum(r.outcome in NON_MODEL for r in g.rollouts)
            bar.set_postfix(non_model_errors=errors_so_far, refresh=False)
            bar.update()
            if len(got) == len(wanted):
                done.set()

    bus = Bus(kafka, client_id="fanroute-rl-preflight")
    bus.subscribe(topic("rollouts"), on_group, group_id=f"rl-preflight-{uuid.uuid4().hex[:8]}")
    await bus.start((topic("tasks"), topic("rollouts")))
    try:
        for t in tasks:
            await bus.publish(topic("tasks"), t)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        bar.close()
        await bus.stop()
    outcomes = Counter(r.outcome for g in got.values() for r in g.rollouts)
    n = sum(outcomes.values())
    errors = sum(outcomes[o] for o in NON_MODEL)
    rewards = [r.reward for g in got.values() for r in g.rollouts]
    return {"tasks": len(tasks), "groups": len(got), "rollouts": n, "outcomes": dict(outcomes),
            "non_model_errors": errors, "non_model_error_rate": errors / n if n else None,
            "flagged": sum(r.flagged for g in got.values() for r in g.rollouts),
            "no_calls": sum(not r.calls for g in got.values() for r in g.rollouts),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "missing_groups": len(tasks) - len(got), "wall_time_s": time.perf_counter() - started}


async def run_recipe(name: str, kafka: KafkaSettings, redis: RedisSettings, tasks_dir: Path, out_dir: Path, *,
                     steps: int | None = None, max_tasks: int | None = None, max_tokens: int | None = None,
                     group_size: int | None = None, lr: float | None = None, base_model: str | None = None,
                     init_adapter: Path | None = None, engine: str = "cpu", vllm_url: str | None = None,
                     print_: Any = print) -> dict[str, Any]:
    """Start the stack, run ``name``, write ``out_dir/<name>.json``; returns that summary."""
    from services.models.prepare import DEFAULT_BASE, resolve_base
    from services.trainer.rl import train_rl_async
    from services.trainer.rl_data import load_tasks
    from services.trainer.settings import TrainerSettings

    r = RECIPES[name]
    r = Recipe(tasks=max_tasks or r.tasks, group_size=group_size or r.group_size,
               groups_per_batch=(max_tasks or r.groups_per_batch) if name == "overfit" else r.groups_per_batch,
               steps=steps or r.steps, max_tokens=max_tokens or r.max_tokens, lr=lr or r.lr,
               max_parallel=r.max_parallel, resample_uniform=r.resample_uniform)
    base = resolve_base(base_model or DEFAULT_BASE, prepare=True)
    tasks = load_tasks(tasks_dir, contested_only=name in ("overfit", "smoke"), limit=r.tasks or None)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_id = f"rl-{name}-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    async with stack(kafka, redis, out_dir / "work", base, r, model_id, engine, vllm_url) as purl:
        t_up = time.perf_counter() - t0
        print_(f"{name}: stack up in {t_up:.0f}s; {len(tasks)} tasks, group size {r.group_size}")
        if name == "preflight":
            summary = await preflight(kafka, tasks, timeout_s=3600)
        else:
            settings = TrainerSettings(
                kafka=kafka, redis=redis, base_model=str(base), output_dir=out_dir / "run", max_steps=r.steps,
                max_tokens=512, lr=r.lr, lr_schedule="constant", eval_fraction=0.0, eval_every=0,
                checkpoint_every=0, publisher_url=purl, model_id=model_id, lora={"dropout": 0.0},
                init_adapter=init_adapter,
                run={"type": "rl", "groups_per_batch": r.groups_per_batch, "max_steps_off_policy": 0,
                     "batch_timeout_s": 3600, "resample_uniform": r.resample_uniform})
            t1 = time.perf_counter()
            result = await train_rl_async(settings, tasks=tasks, out=print_)
            steps_ = [json.loads(x) for x in (out_dir / "run" / "metrics.jsonl").read_text().splitlines()]
            summary = {"steps": [{k: v for k, v in s.items() if k in STEP_KEYS} for s in steps_
                                 if "event" not in s and "step" in s], "run_wall_time_s": time.perf_counter() - t1,
                       "version": result.published["version"] if result.published else None}
    summary |= {"recipe": name, "engine": engine, "model_id": model_id, "stack_start_s": t_up, "wall_time_s": time.perf_counter() - t0,
                "sizes": r.__dict__}
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    if summary.get("steps"):
        plot_steps(summary, out_dir / f"{name}.png")
    return summary


def plot_steps(summary: dict[str, Any], path: Path) -> Path:
    """The training reward per step (mean and median over the batch's rollouts) and the train–inference
    mismatch, the two curves an overfitting run is read by."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in summary["steps"] if "reward/mean" in s]
    x = [s["step"] for s in steps]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax.plot(x, [s["reward/mean"] for s in steps], "o-", label="mean")
    ax.plot(x, [s.get("reward/p50") for s in steps], "s--", label="median")
    ax.set(xlabel="step", ylabel="reward (rollouts of the step)", title=f"{summary.get('recipe')}: training reward")
    ax.legend()
    trained = [s for s in steps if s.get("mismatch") is not None]  # a batch of uniform groups trains nothing
    bx.semilogy([s["step"] for s in trained], [max(s["mismatch"], 1e-12) for s in trained], "o-")
    bx.set(xlabel="step", ylabel="mean |sampler − trainer| logprob", title="train–inference mismatch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


STEP_KEYS = ("step", "reward/mean", "reward/p50", "reward/std", "uniform_groups", "uniform_resampled", "groups",
             "requeues", "lag_mean", "lag_max", "mismatch", "entropy", "grad_norm", "loss", "rows", "shape",
             "micro_batches", "trained_version", "wait_time_s", "train_time_s", "step_time_s", "skipped")


async def main_async(name: str, tasks_dir: Path, out_dir: Path, **kw: Any) -> dict[str, Any]:
    """Against FANROUTE_KAFKA__*/FANROUTE_REDIS__URL when set, else a devstack broker and Redis of its own."""
    import os

    bootstrap = os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("FANROUTE_REDIS__URL")
    ns = f"rl{uuid.uuid4().hex[:6]}."
    if bootstrap and redis_url:
        return await run_recipe(name, KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=ns),
                                RedisSettings(url=redis_url), tasks_dir, out_dir, **kw)
    import devstack

    where = Path(".stack") / f"rl-{name}"
    info = devstack.up(where, 0, 0, libs_dir=Path(".stack") / "kafka-libs")
    try:
        return await run_recipe(name, KafkaSettings(bootstrap_servers=info.bootstrap_servers, topic_namespace=ns),
                                RedisSettings(url=info.redis_url), tasks_dir, out_dir, **kw)
    finally:
        devstack.down(where)
