"""``fanroute chain``: SFT → OPSD → RL, every stage measured on the same held-out queries the way the demo
measures its candidate.

Why a composing command: a stage helps only if routing on queries it never saw gets better, so each adapter
(``sft``, ``sft→opsd``, ``sft→rl``, ``sft→opsd→rl``) goes through ``fanroute eval`` asked as the demo's routed
gateway asks (human qrels, the judge, the linear router beside it) and the trainer's greedy eval (parse rate),
and each row carries a paired bootstrap interval of its difference to the SFT start.

Splits (nothing is tuned on the held-out queries): the demo's training episodes train every stage; OPSD's own ``test/``
figures are a hashed tenth of those training episodes; RL rolls out only the replay tasks of training queries and
evaluates (``--eval-every``) on tasks of held-out queries, which the table's held-out rows also use. The stages' knobs
are fixed in :class:`ChainOptions` before the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.adapter_files import RATES_FILE
from services.common.errors import FanrouteError
from services.common.rewards import DEFAULT_COST_WEIGHT
from services.common.settings import KafkaSettings, RedisSettings
from services.tools.demo_loop import LoopOptions
from services.tools.serving import free_port, served

STAGES = ("sft", "opsd", "rl", "opsd-rl")
LABELS = {"sft": "sft", "opsd": "sft→opsd", "rl": "sft→rl", "opsd-rl": "sft→opsd→rl"}
MODEL = "chain"


@dataclass(frozen=True)
class OpsdKnobs:
    """The OPSD stage: frozen teacher, anchored to the start, small steps, end-of-turn protected."""

    steps: int = 24
    batch_size: int = 4
    group_size: int = 4
    lr: float = 1e-5
    anchor_coef: float = 0.1
    min_reward: float = 0.5
    max_new_tokens: int = 32


@dataclass(frozen=True)
class RlKnobs:
    """The RL stage: contested training tasks, groups of 4, dynamic sampling, held-out evals."""

    steps: int = 12
    group_size: int = 4
    groups_per_batch: int = 8
    lr: float = 2e-5
    eval_every: int = 4
    eval_tasks: int = 24
    resample_uniform: int = 8
    max_tokens: int = 32
    reward: str = "ndcg"
    cost_weight: float = DEFAULT_COST_WEIGHT


@dataclass(frozen=True)
class ChainOptions:
    """Where the demo left its data, which stages to run, and each stage's sizes."""

    demo_dir: Path = Path("out/demo")
    out_dir: Path = Path("out/chain")
    stages: tuple[str, ...] = STAGES
    opsd: OpsdKnobs = field(default_factory=OpsdKnobs)
    rl: RlKnobs = field(default_factory=RlKnobs)
    greedy_eval_max: int = 64
    asked: LoopOptions = field(default_factory=LoopOptions)  # as the demo's routed gateway asks: the SFT row = its eval
    resamples: int = 2000


@dataclass(frozen=True)
class DemoData:
    """What the chain reads from a finished demo run."""

    train_file: Path
    traces_file: Path
    sft_adapter: Path
    held_episodes: list[Any]
    train_tasks: list[Any]
    held_tasks: list[Any]


class ChainInputError(FanrouteError, ValueError):
    """The demo directory lacks what the chain needs (run ``make demo`` first)."""


def load_demo(demo_dir: Path) -> DemoData:
    """The demo's training episodes, held-out traces and episodes, SFT adapter and replay tasks, split by query."""
    from services.trainer.data import load_episodes_file
    from services.trainer.rl_data import load_tasks, task_query

    need = {"train episodes": demo_dir / "train/episodes.jsonl", "eval traces": demo_dir / "eval/traces.jsonl",
            "all episodes": demo_dir / "episodes/episodes.jsonl", "replay tasks": demo_dir / "tasks",
            "SFT adapter": demo_dir / "train/run/adapter", "its table": demo_dir / "train/run/adapter" / RATES_FILE}
    missing = [f"{what} ({path})" for what, path in need.items() if not path.exists()]
    if missing:
        raise ChainInputError(f"{demo_dir} is not a finished demo: missing {', '.join(missing)}; run `make demo`")
    train = load_episodes_file(need["train episodes"])
    trained_ids = {ep.trace_id for ep in train}
    held = [ep for ep in load_episodes_file(need["all episodes"]) if ep.trace_id not in trained_ids]
    held_ids = {ep.trace_id for ep in held}
    tasks = load_tasks(need["replay tasks"])
    train_tasks = [t for t in tasks if t.trace_id in trained_ids]
    train_queries = {task_query(t) for t in train_tasks}
    held_tasks = [t for t in tasks if t.trace_id in held_ids and task_query(t) not in train_queries]
    return DemoData(need["train episodes"], need["eval traces"], need["SFT adapter"], held, train_tasks, held_tasks)


# ----------------------------------------------------------------------------- the stages


def _trainer_common(out_dir: Path, base: Path, init: Path, **kw: Any) -> dict[str, Any]:
    return {"base_model": str(base), "output_dir": out_dir, "init_adapter": init, "lora": {"dropout": 0.0},
            "checkpoint_every": 0, "lr_schedule": "constant", "max_tokens": 512, **kw}


async def run_opsd(data: DemoData, base: Path, init: Path, out_dir: Path, k: OpsdKnobs, print_: Any) -> Path:
    """OPSD from ``init`` on the training episodes against an in-process CPU sampler; its adapter."""
    from services.sampler.app import create_app
    from services.sampler.settings import SamplerSettings
    from services.trainer.opsd import train_opsd
    from services.trainer.settings import TrainerSettings

    port = free_port()
    samp = SamplerSettings(base_model=str(base), port=port, consume_adapters=False,
                           adapter_cache_dir=out_dir / "sampler-cache", kafka=KafkaSettings(bootstrap_servers="memory://"))
    async with served(create_app(samp), port, what="sampler", start_timeout_s=300) as url:
        settings = TrainerSettings(**_trainer_common(
            out_dir, base, init, episodes_file=data.train_file, allow_uncalibrated=True, grades_source="ordering",
            kafka=KafkaSettings(bootstrap_servers="memory://"), max_steps=k.steps, batch_size=k.batch_size,
            lr=k.lr, eval_fraction=0.1, eval_every=max(1, k.steps // 4), eval_max_examples=32,
            eval_max_new_tokens=k.max_new_tokens, model_id=f"{MODEL}-opsd",
            run={"type": "opsd", "sampler_url": url, "group_size": k.group_size, "teacher": "frozen",
                 "anchor_coef": k.anchor_coef, "protect_eot": True, "min_reward": k.min_reward,
                 "max_new_tokens": k.max_new_tokens}))
        result = await asyncio.to_thread(train_opsd, settings, out=print_)
    return Path(result.adapter_dir)


async def run_rl(data: DemoData, base: Path, init: Path, out_dir: Path, k: RlKnobs, kafka: KafkaSettings,
                 redis: RedisSettings, print_: Any) -> Path:
    """RL from ``init`` on the training queries' contested tasks; held-out tasks are its ``test/`` eval."""
    import uuid

    from services.tools.rl_recipes import Recipe, stack
    from services.trainer.rl import train_rl_async
    from services.trainer.settings import TrainerSettings

    contested = [t for t in data.train_tasks if "contested" in t.files.get("task.toml", "")]
    recipe = Recipe(tasks=len(contested), group_size=k.group_size, groups_per_batch=k.groups_per_batch,
                    steps=k.steps, max_tokens=k.max_tokens, lr=k.lr, resample_uniform=k.resample_uniform,
                    reward=k.reward, cost_weight=k.cost_weight)
    model_id = f"{MODEL}-{out_dir.name}-{uuid.uuid4().hex[:4]}"
    async with stack(kafka, redis, out_dir / "work", base, recipe, model_id) as purl:
        settings = TrainerSettings(**_trainer_common(
            out_dir / "run", base, init, kafka=kafka, redis=redis, max_steps=k.steps, lr=k.lr,
            eval_every=k.eval_every, eval_max_examples=k.eval_tasks, publisher_url=purl, model_id=model_id,
            run={"type": "rl", "groups_per_batch": k.groups_per_batch, "max_steps_off_policy": 0,
                 "batch_timeout_s": 3600, "resample_uniform": k.resample_uniform,
                 # the same step in micro-batches of 8 rows: a quarter of the logits in memory at once (32 rows x
                 # 384 tokens x 49k vocabulary is 2.4 GB a copy; with 32 a 12-step stage grew the process to 24 GB)
                 "micro_batch_rows": 8}))
        result = await train_rl_async(settings, tasks=contested, eval_tasks=data.held_tasks, out=print_)
    return Path(result.adapter_dir)


# ----------------------------------------------------------------------------- measuring


def greedy_eval(base: Path, adapter: Path, episodes: list[Any], max_new_tokens: int) -> dict[str, float]:
    """The trainer's own eval of ``adapter`` on held-out episodes: greedy orderings, parse rate, nDCG."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.evaluate import eval_items, evaluate

    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    return evaluate(model, tok, eval_items(tok, episodes, None), max_new_tokens)


async def routed_evals(data: DemoData, base: Path, adapters: dict[str, Path], opts: ChainOptions,
                       print_: Any) -> dict[str, Any]:
    """``fanroute eval`` of every stage's adapter, served side by side by one CPU sampler; stage → report."""
    from services.evaluate.run import EvalOptions, run_eval
    from services.gateway.settings import GatewaySettings
    from services.judge.settings import JudgeSettings
    from services.sampler.app import create_app
    from services.sampler.settings import SamplerSettings
    from services.trainer.sampler_client import SamplerClient

    port, memory = free_port(), KafkaSettings(bootstrap_servers="memory://")
    samp = SamplerSettings(base_model=str(base), port=port, consume_adapters=False, kafka=memory,
                           adapter_cache_dir=opts.out_dir / "eval-sampler-cache")
    judge = JudgeSettings(kafka=memory, redis=RedisSettings(url="memory://"), providers=GatewaySettings().providers)
    reports = {}
    async with served(create_app(samp), port, what="sampler", start_timeout_s=300) as url:
        with SamplerClient(url) as client:
            for stage, path in adapters.items():
                await asyncio.to_thread(client.load_adapter, f"{MODEL}-{stage}@1", str(Path(path).resolve()))
        for stage in adapters:
            t0 = time.perf_counter()
            reports[stage] = await run_eval(EvalOptions(
                train_episodes=data.train_file, candidate=f"{MODEL}-{stage}@1", deployed="none", router_url=url,
                traces_file=data.traces_file, router_timeout_s=opts.asked.router_timeout_s,
                router_max_tokens=opts.asked.router_max_tokens, router_mode=opts.asked.router_mode,
                decision=opts.asked.decision, cost_weight=opts.asked.cost_weight, resamples=opts.resamples,
                rates_file=Path(adapters[stage]) / RATES_FILE, progress=False), judge)  # its own (OPSD/RL inherit)
            print_(f"chain: eval of {LABELS[stage]} in {time.perf_counter() - t0:.0f}s")
    return reports


def _outcomes(report: Any, policy: str) -> dict[str, Any]:
    return {q.trace_id: q.outcomes[policy] for q in report.queries if policy in q.outcomes}


def table(reports: dict[str, Any], greedy: dict[str, dict[str, float]], trained: dict[str, dict[str, Any]],
          resamples: int) -> list[dict[str, Any]]:
    """One row per stage (and the baselines of the SFT report): held-out figures, and the paired
    difference to the SFT start on the human and judge measures."""
    from services.evaluate import policies as pol
    from services.evaluate.metrics import paired

    start = _outcomes(reports["sft"], pol.CANDIDATE)
    rows = []
    for stage, report in reports.items():
        m = report.policies[pol.CANDIDATE]
        mine = _outcomes(report, pol.CANDIDATE)
        oracle = _outcomes(report, pol.JUDGE_ORACLE)
        ids = [t for t in start if t in mine]
        row = {"stage": LABELS[stage], "adapter": report.inputs.candidate, "queries": m.queries,
               "human_ndcg10": m.human.mean, "human_n": m.human.n, "judge": m.judge.mean,
               "cost_per_query_usd": m.cost_per_query_usd, "fallbacks": sum(m.fallbacks.values()),
               "agree_judge_oracle": sum(mine[t].returned == oracle[t].returned for t in mine if t in oracle)
               / max(len(mine), 1)}
        for measure in ("human", "judge"):
            d = paired(stage, "sft", measure, [mine[t] for t in ids], [start[t] for t in ids], resamples=resamples)
            row[f"vs_sft_{measure}"] = {"mean": d.mean_diff, "ci95": d.ci95, "n": d.n}
        g = greedy.get(stage, {})
        row |= {"parse_rate": g.get("test/parse_ok"), "greedy_ndcg_judge": g.get("test/ndcg"), "greedy_n": g.get("test/n")}
        row["trainer"] = trained.get(stage, {})
        rows.append(row)
    sft = reports["sft"]
    for policy in (pol.LINEAR, pol.BEST_SINGLE, pol.JUDGE_ORACLE):
        if policy in sft.policies:
            m = sft.policies[policy]
            rows.append({"stage": policy, "queries": m.queries, "human_ndcg10": m.human.mean, "human_n": m.human.n,
                         "judge": m.judge.mean, "cost_per_query_usd": m.cost_per_query_usd, "baseline": True})
    return rows


def trainer_figures(run_dir: Path) -> dict[str, Any]:
    """A stage's own training figures: first and last eval (``test/``), and OPSD's KL per step."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    evals = [r for r in recs if "event" not in r and any(k.startswith("test/") for k in r)]
    steps = [r for r in recs if "event" not in r and "kl" in r]
    out: dict[str, Any] = {"steps": len([r for r in recs if "event" not in r and "loss" in r])}
    if evals:
        keep = lambda r: {k: v for k, v in r.items() if k.startswith("test/") and isinstance(v, (int, float))}  # noqa: E731
        out |= {"test_first": keep(evals[0]) | {"step": evals[0]["step"]},
                "test_last": keep(evals[-1]) | {"step": evals[-1]["step"]}}
    if steps:
        out["kl"] = [[r["step"], r["kl"], r.get("kl_start")] for r in steps]
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown (what the README carries)."""
    def f(x: Any, spec: str = ".3f") -> str:
        return "—" if x is None else format(x, spec)

    def ci(d: dict[str, Any] | None) -> str:
        if not d or d.get("mean") is None:
            return "—"
        lo, hi = d["ci95"] or (None, None)
        return f"{d['mean']:+.3f} [{f(lo, '+.3f')}, {f(hi, '+.3f')}]"

    def own(t: dict[str, Any] | None) -> str:
        if not t or "test_first" not in t:
            return "—"
        a, b = t["test_first"], t["test_last"]
        key = "test/ndcg" if "test/ndcg" in a else "test/reward/mean"
        name = "nDCG" if key == "test/ndcg" else "reward"
        return f"{name} {a.get(key, float('nan')):.3f} → {b.get(key, float('nan')):.3f} (step {b['step']})"

    out = ["| stage | held-out nDCG@10 (human) | Δ vs sft, 95 % CI | judge grade | Δ judge vs sft | cost / query | "
           "parse rate | agrees with judge-oracle | its own eval, start → end |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("baseline"):
            out.append(f"| *{r['stage']}* | {f(r['human_ndcg10'])} | | {f(r['judge'], '.2f')} | | "
                       f"${r['cost_per_query_usd']:.5f} | | | |")
        else:
            out.append(f"| **{r['stage']}** | {f(r['human_ndcg10'])} | {ci(r.get('vs_sft_human'))} | "
                       f"{f(r['judge'], '.2f')} | {ci(r.get('vs_sft_judge'))} | ${r['cost_per_query_usd']:.5f} | "
                       f"{f(r.get('parse_rate'), '.2f')} | {f(r.get('agree_judge_oracle'), '.0%')} | "
                       f"{own(r.get('trainer'))} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the run


def plot(out_dir: Path, stages: dict[str, Path]) -> Path:
    """OPSD's teacher–student KL (and KL to the start) per step, its parse rate, and RL's held-out reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 3.8))
    opsd = trainer_figures(stages["opsd"]) if "opsd" in stages else {}
    if opsd.get("kl"):
        x = [r[0] for r in opsd["kl"]]
        ax.plot(x, [r[1] for r in opsd["kl"]], "o-", ms=3, label="teacher–student (per token)")
        ax.plot(x, [r[2] for r in opsd["kl"]], "s--", ms=3, label="student–start (per token)")
        ax.legend()
    ax.set(xlabel="OPSD step", ylabel="reverse KL estimate", title="OPSD: KL per step")
    for stage in ("opsd",):
        recs = _records(stages.get(stage))
        ev = [r for r in recs if "test/parse_ok" in r and "event" not in r]
        bx.plot([r["step"] for r in ev], [r["test/parse_ok"] for r in ev], "o-", label="parse rate")
        bx.plot([r["step"] for r in ev], [r["test/ndcg"] for r in ev], "s--", label="nDCG (judge ordering)")
    bx.axhline(0.98, color="grey", lw=0.8, ls=":")
    bx.set(xlabel="OPSD step", ylim=(0, 1.02), title="OPSD: training split's validation tenth")
    bx.legend()
    for stage in ("rl", "opsd-rl"):
        ev = [r for r in _records(stages.get(stage)) if "test/reward/mean" in r and "event" not in r]
        cx.plot([r["step"] for r in ev], [r["test/reward/mean"] for r in ev], "o-", label=LABELS[stage])
    cx.set(xlabel="RL step", ylabel="mean reward", title="RL: held-out tasks (test/reward)")
    if cx.lines:
        cx.legend()
    fig.tight_layout()
    path = out_dir / "chain.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _records(run_dir: Path | None) -> list[dict[str, Any]]:
    path = (run_dir / "metrics.jsonl") if run_dir is not None else None
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path and path.is_file() else []


def _done(adapter: Path) -> bool:
    return (adapter / "adapter_config.json").is_file()


async def run_chain(opts: ChainOptions, print_: Any = print) -> dict[str, Any]:
    """Train the stages (an adapter already under ``out_dir`` is reused), measure all, write chain.json/.md/.png."""
    from services.models.prepare import DEFAULT_BASE, resolve_base

    t0 = time.perf_counter()
    data = load_demo(opts.demo_dir)
    base = resolve_base(DEFAULT_BASE, prepare=True)
    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    print_(f"chain: {len(data.held_episodes)} held-out episodes, {len(data.train_tasks)} training-query tasks, "
           f"{len(data.held_tasks)} held-out tasks; stages {', '.join(LABELS[s] for s in opts.stages)}")
    adapters: dict[str, Path] = {"sft": data.sft_adapter}
    run_dirs: dict[str, Path] = {"sft": data.sft_adapter.parent}
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}

    async def stage(name: str, make: Any) -> None:
        target = out / name / ("run/adapter" if name in ("rl", "opsd-rl") else "adapter")
        run_dirs[name] = target.parent
        if _done(target):
            print_(f"chain: {LABELS[name]}: reusing {target}")
            adapters[name] = target
            return
        t = time.perf_counter()
        try:
            adapters[name] = await make()
        except Exception as exc:  # one stage failing still leaves the others measured; the error is recorded
            errors[name] = f"{type(exc).__name__}: {exc}"
            print_(f"chain: {LABELS[name]} FAILED: {errors[name]}")
        timings[name] = round(time.perf_counter() - t, 1)

    if "opsd" in opts.stages or "opsd-rl" in opts.stages:
        await stage("opsd", lambda: run_opsd(data, base, data.sft_adapter, out / "opsd", opts.opsd, print_))
    rl_stages = [s for s in ("rl", "opsd-rl") if s in opts.stages and (s == "rl" or "opsd" in adapters)]
    if rl_stages and not all(_done(out / s / "run" / "adapter") for s in rl_stages):
        import uuid

        import devstack

        where = Path(".stack") / "chain"
        info = await asyncio.to_thread(devstack.up, where, 0, 0, libs_dir=Path(".stack") / "kafka-libs")
        try:
            for s in rl_stages:
                kafka = KafkaSettings(bootstrap_servers=info.bootstrap_servers, topic_namespace=f"chain{uuid.uuid4().hex[:6]}.")
                init = data.sft_adapter if s == "rl" else adapters["opsd"]
                await stage(s, lambda s=s, kafka=kafka, init=init: run_rl(
                    data, base, init, out / s, opts.rl, kafka, RedisSettings(url=info.redis_url), print_))
        finally:
            await asyncio.to_thread(devstack.down, where)
    else:
        for s in rl_stages:
            await stage(s, lambda: None)  # reused
    measured = {s: adapters[s] for s in STAGES if s in adapters and (s in opts.stages or s == "sft")}
    t = time.perf_counter()
    greedy = {}
    for s, path in measured.items():
        greedy[s] = await asyncio.to_thread(greedy_eval, base, path, data.held_episodes[:opts.greedy_eval_max],
                                            opts.opsd.max_new_tokens)
        print_(f"chain: greedy eval of {LABELS[s]}: parse {greedy[s]['test/parse_ok']:.2f}, "
               f"nDCG {greedy[s]['test/ndcg']:.3f} (n={greedy[s]['test/n']})")
    reports = await routed_evals(data, base, measured, opts, print_)
    timings["eval"] = round(time.perf_counter() - t, 1)
    rows = table(reports, greedy, {s: trainer_figures(run_dirs[s]) for s in measured}, opts.resamples)
    for s, report in reports.items():
        (out / f"eval-{s}.json").write_text(report.model_dump_json(indent=2) + "\n")
    summary = {"options": json.loads(json.dumps(asdict(opts), default=str)), "rows": rows, "errors": errors,
               "timings_s": timings | {"total": round(time.perf_counter() - t0, 1)},
               "splits": {"train_episodes": str(data.train_file), "held_out_episodes": len(data.held_episodes),
                          "greedy_eval_episodes": min(len(data.held_episodes), opts.greedy_eval_max),
                          "training_query_tasks": len(data.train_tasks), "held_out_tasks": len(data.held_tasks),
                          "held_out_traces": str(data.traces_file)},
               "adapters": {s: str(p) for s, p in measured.items()}}
    (out / "chain.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    (out / "chain.md").write_text(render(rows) + "\n")
    plot(out, run_dirs)
    print_(render(rows))
    return summary


def options_with(opts: ChainOptions, **kw: Any) -> ChainOptions:
    """``opts`` with ``opsd_<knob>`` / ``rl_<knob>`` / top-level overrides (None = keep)."""
    top = {k: v for k, v in kw.items() if v is not None and not k.startswith(("opsd_", "rl_"))}
    o = {k[5:]: v for k, v in kw.items() if v is not None and k.startswith("opsd_")}
    r = {k[3:]: v for k, v in kw.items() if v is not None and k.startswith("rl_")}
    return replace(opts, opsd=replace(opts.opsd, **o), rl=replace(opts.rl, **r), **top)


__all__ = ["ChainInputError", "ChainOptions", "OpsdKnobs", "RlKnobs", "STAGES", "load_demo", "options_with",
           "render", "run_chain", "table"]
