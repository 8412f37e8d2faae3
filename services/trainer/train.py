"""The training run: plan (data, gate, split, batches), then LoRA steps, evaluation, checkpoints, publish.

:func:`plan_run` does everything that needs no weights, so ``--dry-run`` prints exactly what a
run would train on. :func:`train` runs it: at most one pass over the training episodes (with N
episodes and G per batch, ceil(N/G) steps, however many were asked), the LR schedule defined over
that pass (so ``max_steps`` only stops early and a resumed run continues the same schedule).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from schemas.episode import Episode
from services.common.adapter_files import RATES_FILE
from services.common.errors import BusError, ConfigError, FanrouteError
from services.common.files import atomic_dir
from services.common.prompt import retarget, tie_variants
from services.models.prepare import is_prepared, resolve_base
from services.router.linear import first_choice
from services.router.rates import to_json as rates_json
from services.router.rates import top_tier_rates
from services.trainer import checkpoint as ckpt
from services.trainer.data import (
    Example,
    GateCheck,
    GateLookup,
    balance_weights,
    batch_order,
    build_examples,
    check_gates,
    episode_judge,
    judge_keys,
    kafka_gate_lookup,
    load_episodes_file,
    load_episodes_topic,
    padding_stats,
    select,
    split_by_query,
)
from services.trainer.evaluate import GradesFor, eval_items, evaluate, load_kafka_grades
from services.trainer.route_eval import route_evaluate, route_items
from services.trainer.settings import TrainerSettings
from services.trainer.sft_step import train_step as _train_step

Out = Callable[[str], None]


class Publisher(Protocol):
    """Anything that can publish a finished adapter (e.g. services.common.publisher_client.PublisherClient)."""

    def publish(self, model_id: str, adapter_dir: Path, base_model: str, metrics: dict) -> dict: ...


class DivergedError(FanrouteError, FloatingPointError):
    """The loss or the gradient norm stopped being a finite number: nothing is saved or published."""


class PublishError(FanrouteError, RuntimeError):
    """Training finished and the adapter is saved, but the publisher refused or failed."""


def _print(line: str) -> None:
    print(line, flush=True)


@dataclass
class Plan:
    """What a run will train on and how, resolved without loading weights."""

    settings: TrainerSettings
    source: str
    counts: dict[str, Any]
    gates: list[GateCheck]
    train_episodes: list[Episode]
    eval_episodes: list[Episode]
    base_dir: Path
    tokenizer: Any = None
    examples: list[Example] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)
    # the top-tier table of the training episodes (before retargeting), written beside the adapter
    rates: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def steps_per_pass(self) -> int:
        return len(self.batches)

    @property
    def steps(self) -> int:
        return min(self.settings.max_steps, self.steps_per_pass)

    @property
    def capped(self) -> bool:
        return self.settings.max_steps > self.steps_per_pass

    @property
    def uncalibrated_episodes(self) -> int:
        return sum(g.episodes for g in self.gates if g.status != "open")

    def one_pass_line(self) -> str:
        """The one-pass rule, said out loud."""
        n, g, variants = len(self.examples), self.settings.batch_size, self.counts.get("tie_variants", 0)
        what = f"{n - variants} training episodes ({n} examples with tie variants)" if variants else f"{n} training episodes"
        head = f"one pass over {what} at {g} per batch is {self.steps_per_pass} steps"
        if self.capped:
            return f"{head}; stopping after {self.steps} although max_steps={self.settings.max_steps} was asked"
        return f"{head}; running {self.steps} (max_steps={self.settings.max_steps})"

    def data_fingerprint(self) -> str:
        """Hash of the training episode ids in example order (a resume must see the same data)."""
        return hashlib.sha256("\n".join(e.episode_id for e in self.examples).encode()).hexdigest()[:24]

    def record(self) -> dict[str, Any]:
        """The plan as JSON-able data (config.json, dry-run output, the metrics header)."""
        return {
            "config": self.settings.model_dump(mode="json"),
            "base_model_dir": str(self.base_dir),
            "source": self.source,
            "data": self.counts,
            "gates": [asdict(g) | {"providers": list(g.providers)} for g in self.gates],
            "allow_uncalibrated": self.settings.allow_uncalibrated,
            "uncalibrated_episodes": self.uncalibrated_episodes,
            "one_pass": {"steps_asked": self.settings.max_steps, "steps_per_pass": self.steps_per_pass,
                         "steps": self.steps, "capped": self.capped, "message": self.one_pass_line()}
            if self.batches else None,
        }


@dataclass
class RunResult:
    """What a run did."""

    trained: bool
    steps: int
    output_dir: Path
    plan: Plan
    adapter_dir: Path | None = None
    final_metrics: dict[str, Any] = field(default_factory=dict)
    published: dict | None = None


# ----------------------------------------------------------------------------- planning


def _from_kafka(fn: Callable[[], Any], what: str, settings: TrainerSettings) -> Any:
    """Run a Kafka read; an unreachable broker is a BusError that says what was being read."""
    try:
        return fn()
    except Exception as exc:  # aiokafka raises its own hierarchy; keep the message, name the job
        if type(exc).__module__.startswith("aiokafka"):
            raise BusError(f"reading {what} from Kafka at {settings.kafka.bootstrap_servers}: {exc}") from exc
        raise


def load_dataset(settings: TrainerSettings, episodes: Sequence[Episode] | None) -> tuple[list[Episode], str]:
    """Episodes (given, from the file, or from the topic as of a time) and where they came from."""
    if episodes is not None:
        return list(episodes), "given"
    if settings.episodes_file is not None:
        return load_episodes_file(settings.episodes_file), f"file {settings.episodes_file}"
    as_of = settings.as_of or datetime.now(UTC)
    found = _from_kafka(lambda: asyncio.run(load_episodes_topic(settings.kafka, as_of)), "episodes", settings)
    return found, f"topic episodes as of {as_of.isoformat()}"


def plan_run(settings: TrainerSettings, *, episodes: Sequence[Episode] | None = None,
             gate_lookup: GateLookup | None = None) -> Plan:
    """Load, select, gate, split and tokenize; the batch order of the one pass. No weights loaded."""
    found, source = load_dataset(settings, episodes)
    run = settings.run
    selection = select(found, run.reward_name, run.reward_min, run.reward_max)
    if gate_lookup is None and not (settings.allow_uncalibrated and settings.episodes_file is not None):
        wanted = judge_keys(selection.kept, run.reward_name)
        gate_lookup = _from_kafka(lambda: asyncio.run(kafka_gate_lookup(settings.kafka, wanted)),
                                  "calibration gates", settings)
    gates = check_gates(selection.kept, run.reward_name, gate_lookup, settings.allow_uncalibrated)
    train_eps, eval_eps = split_by_query(selection.kept, settings.eval_fraction)
    # the target rewrites only what is trained on: the eval episodes keep the judge's whole ordering to grade by
    target = getattr(run, "target", "ordering")
    rates = top_tier_rates(train_eps)
    smoothing = getattr(run, "tie_smoothing", 0.0)
    variants = [(ep.episode_id, *v) for ep in train_eps for v in tie_variants(ep, smoothing)] if smoothing else []
    train_eps = [retarget(ep, target) for ep in train_eps]
    counts: dict[str, Any] = dict(selection.counts) | {"reward": selection.reward, "train_episodes": len(train_eps),
                                                       "eval_episodes": len(eval_eps), "target": target}
    if not train_eps:
        raise ConfigError(f"eval_fraction {settings.eval_fraction} holds out every one of the "
                          f"{len(selection.kept)} selected episodes; nothing is left to train on")
    base_dir = resolve_base(settings.base_model, prepare=not settings.dry_run)
    plan = Plan(settings, source, counts, gates, train_eps, eval_eps[:settings.eval_max_examples], base_dir,
                rates=rates)
    if not is_prepared(base_dir) and not (base_dir / "tokenizer_config.json").is_file():
        counts["tokens"] = f"not counted: {base_dir} is not prepared (fanroute models prepare)"
        return plan
    from transformers import AutoTokenizer

    plan.tokenizer = AutoTokenizer.from_pretrained(base_dir)
    # with tie smoothing, one weighted example per tied provider (variant ids are "<episode id>#<provider>")
    smooth = {v.episode_id: w for _, v, w in variants}
    origin = {v.episode_id: orig for orig, v, _ in variants}
    built = build_examples(plan.tokenizer, [v for _, v, _ in variants] or train_eps, settings.max_tokens)
    counts.update(built.counts)
    if not built.examples:
        raise ConfigError(f"max_tokens {settings.max_tokens} cuts off the assistant turn of every training episode")
    if variants:
        counts["tie_variants"] = len(variants) - len(train_eps)
    labels = {ep.episode_id: first_choice(ep) for ep in train_eps}
    weights = balance_weights([labels.get(origin.get(e.episode_id, e.episode_id)) for e in built.examples],
                              getattr(run, "class_balance", 0.0))
    plan.examples = [replace(e, weight=w * smooth.get(e.episode_id, 1.0))
                     for e, w in zip(built.examples, weights, strict=True)]
    if variants:  # an episode's variants share a batch, so each episode weighs 1 in its batch's weighted mean
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(built.examples):
            groups.setdefault(origin.get(e.episode_id, e.episode_id), []).append(i)
        members = list(groups.values())
        plan.batches = [[i for g in batch for i in members[g]] for batch in batch_order(
            [max(len(built.examples[i].input_ids) for i in m) for m in members], settings.batch_size,
            settings.bucket_window, settings.seed)]
    else:
        plan.batches = batch_order([len(e.input_ids) for e in built.examples], settings.batch_size,
                                   settings.bucket_window, settings.seed)
    counts.update(padding_stats(built.examples, plan.batches))
    return plan


def grades_lookup(plan: Plan, grades_for: GradesFor | None) -> GradesFor | None:
    """The eval grades source: injected, the verdicts topic, or None (tier ranks of the ordering)."""
    s = plan.settings
    if grades_for is not None or not plan.eval_episodes:
        return grades_for
    if s.grades_source == "ordering" or (s.grades_source == "auto" and s.episodes_file is not None):
        return None
    wanted = {ep.trace_id: key for ep in plan.eval_episodes
              if ep.trace_id and (key := episode_judge(ep, s.run.reward_name)) is not None}
    return _from_kafka(lambda: load_kafka_grades(s.kafka, wanted), "verdicts", s)


def publisher_for(settings: TrainerSettings) -> Publisher | None:
    """A PublisherClient for ``publisher_url`` (imported only when one is configured)."""
    if settings.publisher_url is None:
        return None
    try:
        from services.common.publisher_client import PublisherClient
    except ImportError as exc:
        raise ConfigError(f"publisher_url is set but services.common.publisher_client is not available: {exc}") from exc
    return PublisherClient(settings.publisher_url)


# ----------------------------------------------------------------------------- model


def build_model(plan: Plan, out: Out) -> Any:
    """The base model with a trainable LoRA adapter (fresh, seeded; or loaded from init_adapter)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from services.models.load import load_causal_lm

    s = plan.settings
    torch.manual_seed(s.seed)
    base = load_causal_lm(plan.base_dir, torch.float32)
    if s.init_adapter is not None:
        if not (s.init_adapter / "adapter_config.json").is_file():
            raise ConfigError(f"init_adapter {s.init_adapter} is not a peft adapter directory (no adapter_config.json)")
        from services.common.hf import model_loading
        from services.models.adapters import AdapterMismatchError, check_adapter_fits

        try:
            check_adapter_fits(base, s.init_adapter)
        except AdapterMismatchError as exc:
            raise ConfigError(f"init_adapter: {exc}") from exc
        out(f"starting from adapter {s.init_adapter} (its LoRA shape replaces the lora settings)")

        with model_loading():
            model = PeftModel.from_pretrained(base, s.init_adapter, is_trainable=True)
    else:
        cfg = LoraConfig(r=s.lora.r, lora_alpha=s.lora.alpha, lora_dropout=s.lora.dropout,
                         target_modules=list(s.lora.target_modules), task_type="CAUSAL_LM")
        try:
            model = get_peft_model(base, cfg)
        except ValueError as exc:
            raise ConfigError(f"LoRA target modules {list(s.lora.target_modules)} do not fit the base: {exc}") from exc
    model.train()
    return model


def build_optimizer(plan: Plan, model: Any) -> tuple[Any, Any]:
    """AdamW over the adapter's parameters and an LR schedule over one pass."""
    import torch
    from transformers import get_scheduler

    s = plan.settings
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    name = "constant_with_warmup" if s.lr_schedule == "constant" else s.lr_schedule
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=s.warmup_steps,
                              num_training_steps=max(plan.steps_per_pass, 1))
    return optimizer, scheduler


# ----------------------------------------------------------------------------- the run


class MetricsLog:
    """metrics.jsonl in the run directory: one JSON object per line, appended to on resume."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        if fresh:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, sort_keys=True, default=str) + "\n")


def inherited_rates(init_adapter: Path | None) -> dict[str, Any] | None:
    """The top-tier table document of the adapter a run starts from (OPSD/RL keep their SFT start's table)."""
    path = init_adapter / RATES_FILE if init_adapter is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _save_adapter(model: Any, target: Path, rates_doc: dict[str, Any] | None = None) -> Path:
    """The adapter and (when given) its top-tier table document, written next to ``target`` and renamed into place."""
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        if rates_doc is not None:
            (tmp / RATES_FILE).write_text(json.dumps(rates_doc, sort_keys=True) + "\n")
    return target


def train(settings: TrainerSettings, *, episodes: Sequence[Episode] | None = None,
          gate_lookup: GateLookup | None = None, grades_for: GradesFor | None = None,
          publisher: Publisher | None = None, out: Out = _print) -> RunResult:
    """Plan, then (unless dry-run) train, evaluate, checkpoint and publish; see the module docstring."""
    plan = plan_run(settings, episodes=episodes, gate_lookup=gate_lookup)
    s, output_dir = settings, settings.output_dir
    if s.dry_run:
        out(json.dumps(plan.record(), indent=2, sort_keys=True, default=str))
        out(f"dry run: {plan.one_pass_line() if plan.batches else 'tokens not counted'}; nothing trained")
        return RunResult(False, 0, output_dir, plan)
    if s.allow_uncalibrated and plan.uncalibrated_episodes:
        out(f"allow_uncalibrated: training on {plan.uncalibrated_episodes} episodes without an open gate")
    publisher = publisher if publisher is not None else publisher_for(s)
    latest = ckpt.resumable(output_dir, s.resume)
    output_dir.mkdir(parents=True, exist_ok=True)
    eval_set = eval_items(plan.tokenizer, plan.eval_episodes, grades_lookup(plan, grades_for))
    route_set = route_items(plan.tokenizer, plan.eval_episodes, [i.grades for i in eval_set],
                            [i.providers for i in eval_set])

    import torch

    if s.threads:
        torch.set_num_threads(s.threads)
    model = build_model(plan, out)
    optimizer, scheduler = build_optimizer(plan, model)
    fingerprint = s.fingerprint_fields() | {"data": plan.data_fingerprint()}
    start = 0
    if latest is not None:
        ckpt.check_fingerprint(ckpt.read_progress(latest).fingerprint, json.loads(json.dumps(fingerprint)), latest)
        progress = ckpt.load_checkpoint(latest, model, optimizer, scheduler)
        start, plan.batches = progress.step, progress.batches
        if start > plan.steps:
            raise ConfigError(f"{latest} is at step {start}, past max_steps={s.max_steps}")
        out(f"resumed from {latest} at step {start}")
    metrics = MetricsLog(output_dir / "metrics.jsonl", fresh=latest is None)
    header = plan.record() | {"event": "start", "step": start, "resumed_from": start if latest else None}
    (output_dir / "config.json").write_text(json.dumps(plan.record(), indent=2, sort_keys=True, default=str) + "\n")
    metrics.write(header)
    out(plan.one_pass_line())
    pad_id = plan.tokenizer.pad_token_id if plan.tokenizer.pad_token_id is not None else plan.tokenizer.eos_token_id
    final: dict[str, Any] = {}

    def run_eval(step: int) -> None:
        if eval_set:
            scores = evaluate(model, plan.tokenizer, eval_set, s.eval_max_new_tokens)
            scores |= route_evaluate(model, route_set, pad_id, plan.rates, s.route_cost_table, s.route_cost_weight)
            metrics.write({"step": step, **scores})
            final.update(scores)
            routed = (f"; routed (score mode): grade {scores['test/route_grade']:.2f} best {scores['test/route_best']:.2f} "
                      f"agree {scores['test/route_agree']:.2f}" if "test/route_grade" in scores else "")
            if "test/route_cost" in scores:
                routed += f" cost ${scores['test/route_cost'] * 1000:.2f}m at λ {s.route_cost_weight:g}"
            out(f"eval step {step}: ndcg {scores['test/ndcg']:.3f} top1 {scores['test/top1']:.3f} "
                f"parsed {scores['test/parse_ok']:.2f} (n={scores['test/n']}){routed}")

    def save(step: int) -> None:
        ckpt.save_checkpoint(output_dir, model, optimizer, scheduler,
                             ckpt.Progress(step, plan.batches, fingerprint), s.keep_checkpoints)

    for step in range(start + 1, plan.steps + 1):
        rec = _train_step(model, optimizer, scheduler, [plan.examples[i] for i in plan.batches[step - 1]], pad_id,
                          s.max_grad_norm, micro_batch_tokens=s.micro_batch_tokens)
        rec = {"step": step, "epoch": step / plan.steps_per_pass, **rec}
        metrics.write(rec)
        final.update({f"train/{k}": v for k, v in rec.items() if k not in ("step", "epoch")})
        out(f"step {step}/{plan.steps} loss {rec['loss']:.4f} grad_norm {rec['grad_norm']:.3f} lr {rec['lr']:.2e} "
            f"tok/s {rec['tokens_per_s']:.0f} nonpad {rec['nonpad_fraction']:.2f} "
            f"({rec['step_time_s']:.2f}s, {rec['epoch']:.2f} of a pass)")
        if not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])):
            raise DivergedError(f"step {step}: loss {rec['loss']} / grad norm {rec['grad_norm']} is not finite; "
                                f"stopped without saving or publishing (metrics in {output_dir / 'metrics.jsonl'})")
        ckpt.after_step(step, plan.steps, s.checkpoint_every, s.eval_every, save, run_eval)
    ckpt.at_end(start, plan.steps, save, run_eval)
    adapter_dir = _save_adapter(model, output_dir / "adapter", rates_json(plan.rates, len(plan.train_episodes)))
    final |= {"steps": plan.steps, "episodes": len(plan.examples) - plan.counts.get("tie_variants", 0),
              "allow_uncalibrated": s.allow_uncalibrated,
              "uncalibrated_episodes": plan.uncalibrated_episodes, "one_pass_capped": plan.capped}
    metrics.write({"event": "end", "step": plan.steps, **final})
    published: dict | None = None
    failure: Exception | None = None
    if publisher is not None:
        try:
            numeric = {k: float(v) for k, v in final.items() if isinstance(v, (int, float))}  # the wire is str→float
            published = publisher.publish(s.publish_id, adapter_dir, s.base_model, numeric)
            out(f"published {s.publish_id}: {published}")
        except Exception as exc:  # any client error: the run's result stays on disk, the caller is told
            failure, published = exc, {"error": f"{type(exc).__name__}: {exc}"}
    (output_dir / "summary.json").write_text(json.dumps(
        {"final": final, "adapter_dir": str(adapter_dir), "published": published}, indent=2, sort_keys=True,
        default=str) + "\n")
    if failure is not None:
        raise PublishError(f"trained {plan.steps} steps (adapter at {adapter_dir}) but publishing "
                           f"{s.publish_id} failed: {failure}") from failure
    out(f"done: {plan.steps} steps, adapter at {adapter_dir}")
    return RunResult(True, plan.steps, output_dir, plan, adapter_dir, final, published)
