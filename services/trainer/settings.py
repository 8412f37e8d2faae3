"""Trainer settings: ``FANROUTE_`` env vars (nested with ``__``) overridden by command-line flags.

A run kind is a discriminated union on ``type`` (``sft``, ``opsd`` and ``rl``), so a config names
what it trains and carries only that kind's knobs. Every
flag is generated from the fields here, so ``--help`` and validation can never drift apart.
"""

from __future__ import annotations

import argparse
import types
import typing
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from services.common.files import instant
from services.common.prompt import TARGETS
from services.common.settings import ServiceSettings
from services.models.prepare import DEFAULT_BASE


class SftRun(BaseModel):
    """Supervised fine-tuning on the judge's orderings (loss on the assistant turn only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["sft"] = Field(default="sft", description="Run kind")
    reward_name: str | None = Field(default=None, min_length=1, max_length=256,
                                    description="Reward the window applies to (default: the episode's "
                                                "first ndcg:<judge>:<rubric> component)")
    reward_min: float | None = Field(default=None, ge=-1e6, le=1e6,
                                     description="Keep episodes whose reward is at least this")
    reward_max: float | None = Field(default=None, ge=-1e6, le=1e6,
                                     description="Keep episodes whose reward is at most this")
    target: Literal[TARGETS] = Field(  # type: ignore[valid-type]
        default="first", description="What the assistant turn trains on: the judge's cost-aware first choice "
                                     "(the decision the router is asked for), its top tier, or the whole ordering")
    class_balance: float = Field(
        default=0.0, ge=0, le=1, description="Loss weight per example ∝ (examples sharing its cost-aware first "
                                             "choice) ** -class_balance: 0 off, 0.5 square-root, 1 equal per label")
    tie_smoothing: float = Field(
        default=0.0, ge=0, le=0.9, description="Label smoothing over the judge's top tier (target first only): "
                                               "this share of each episode's loss is spread evenly over every "
                                               "provider in its top tier, the rest stays on the cost-aware first "
                                               "choice; one weighted example per tied provider. 0 off")

    @model_validator(mode="after")
    def _window(self) -> SftRun:
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward_min {self.reward_min} is above reward_max {self.reward_max}")
        if self.tie_smoothing and self.target != "first":
            raise ValueError(f"tie_smoothing {self.tie_smoothing} applies to target first only (target is "
                             f"{self.target}: its assistant turn already names the tied providers, or every one)")
        return self


LOSS_NAMES = ("importance_sampling", "ppo", "cispo", "gspo", "dppo")
HINT_FIELDS = ("query", "providers", "answer", "rewards", "reward")


class PolicyLoss(BaseModel):
    """The policy-gradient loss knobs OPSD and RL share."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    loss: Literal[LOSS_NAMES] = Field(default="importance_sampling",  # type: ignore[valid-type]
                                      description="Policy-gradient loss (services/trainer/losses.py)")
    clip_low: float | None = Field(default=None, gt=0, le=10,
                                   description="Lower clip / trust-region bound of the loss (default: the loss's own)")
    clip_high: float | None = Field(default=None, gt=0, le=10,
                                    description="Upper clip / trust-region bound of the loss (default: the loss's own)")


class OpsdRun(PolicyLoss):
    """On-policy self-distillation: the current adapter's samples, pulled toward what it says given a hint."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["opsd"] = Field(default="opsd", description="Run kind")
    sampler_url: str = Field(default="http://127.0.0.1:8001", min_length=1, max_length=2048,
                             description="The sampler (CPU sampler or vLLM) that samples and scores over HTTP")
    hint_mode: Literal["reward", "custom"] = Field(
        default="reward", description="Teacher's hint: the episode's reward map and recorded answer, or "
                                      "--hint-template")
    hint_template: str | None = Field(
        default=None, max_length=8192,
        description="Rubric for --hint-mode custom, a str.format template over "
                    f"{{{'}, {'.join(HINT_FIELDS)}}} (e.g. 'A good answer for {{query}}: {{answer}}')")
    min_reward: float = Field(default=0.5, ge=-1e6, le=1e6,
                              description="Keep episodes whose reward (reward_name) is at least this")
    reward_name: str | None = Field(default=None, min_length=1, max_length=256,
                                    description="Reward --min-reward reads and the hint names (default: the "
                                                "episode's primary ndcg reward)")
    group_size: int = Field(default=2, ge=2, le=64,
                            description="Orderings sampled per prompt and step (at least 2)")
    kl_penalty_coef: float = Field(default=1.0, gt=0, le=100,
                                   description="Scale of the per-token advantage -(log p_student - log q_teacher)")
    teacher: Literal["frozen", "live"] = Field(
        default="frozen", description="Who scores the hinted prompt: frozen = the starting adapter for the whole "
                                      "run (a fixed target); live = the adapter being trained (the target moves "
                                      "with the student)")
    anchor_coef: float = Field(default=0.0, ge=0, le=100,
                               description="KL anchor: adds -anchor_coef·(log p_student - log p_start) per token, "
                                           "pulling the student back toward the starting adapter on its own "
                                           "prompt (0 = off)")
    protect_eot: bool = Field(default=True,
                              description="Never push the end-of-turn token down: its per-token advantage is "
                                          "clipped at 0, so the hint cannot teach answers that do not stop")
    temperature: float = Field(default=1.0, ge=0.05, le=2,
                               description="Sampling temperature (1 = the policy itself; the sampler reports raw "
                                           "logprobs, so another value samples off-policy)")
    max_new_tokens: int = Field(default=48, ge=1, le=1024, description="Most tokens per sampled ordering")
    sample_concurrency: int = Field(default=8, ge=1, le=256,
                                    description="Sampling requests in flight at once (the sampler decodes them as "
                                                "one batch; 1 = one at a time, bit-reproducible)")
    sampler_timeout_s: float = Field(default=120.0, gt=0, le=3600, description="Timeout of one sampler request")

    @model_validator(mode="after")
    def _hint(self) -> OpsdRun:
        if self.hint_mode == "custom":
            if not (self.hint_template or "").strip():
                raise ValueError("hint_mode custom needs a non-empty hint_template (the rubric the teacher sees)")
            import string

            names = {f for _, f, _, _ in string.Formatter().parse(self.hint_template or "") if f is not None}
            unknown = sorted(n for n in names if n.split(".")[0].split("[")[0] not in HINT_FIELDS)
            if unknown or "" in names:
                raise ValueError(f"hint_template names {unknown or ['{}']}; it may use {{{'}, {'.join(HINT_FIELDS)}}}")
        elif self.hint_template is not None:
            raise ValueError("hint_template is only read with hint_mode custom")
        return self


class RlRun(PolicyLoss):
    """RL against the replay grader: groups from ``rollouts`` (the rollout runner's), stale ones requeued."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["rl"] = Field(default="rl", description="Run kind")
    tasks_dir: Path | None = Field(default=None, description="Replay tasks (one directory per task, as `fanroute "
                                                             "episodes` writes them) the run feeds to the runner")
    eval_tasks_dir: Path | None = Field(
        default=None, description="Replay tasks of held-out queries the eval rolls out (every task of tasks_dir then "
                                  "trains; a task whose trace or query is in both is refused). Default: a "
                                  "hashed eval_fraction of tasks_dir")
    contested_only: bool = Field(default=False, description="Only tasks tagged contested in task.toml")
    max_tasks: int | None = Field(default=None, ge=1, le=1_000_000,
                                  description="First N tasks (sorted by id) after filtering (default: all)")
    groups_per_batch: int = Field(default=8, ge=1, le=4096, description="Finished groups one step takes")
    max_steps_off_policy: int = Field(default=2, ge=0, le=1000,
                                      description="Requeue groups more steps behind than this (0 = synchronous)")
    batch_timeout_s: float = Field(default=1800.0, gt=0, le=86_400,
                                   description="Give up when a batch's groups have not all come back in this time")
    pack_multiple: int = Field(default=32, ge=1, le=8192,
                               description="Token packing: rows padded to a multiple of this, so shapes repeat")
    fixed_shape: bool = Field(default=False, description="Pad every batch to max_tokens and to the most rows any "
                                                         "batch had so far (one shape for the whole run)")
    resample_uniform: int = Field(default=0, ge=0, le=100_000,
                                  description="Dynamic sampling (DAPO): up to this many uniform groups a step are "
                                              "set aside, the next task rolled out in each one's place (the same "
                                              "task when it is the only one; 0: they fill the batch)")
    micro_batch_rows: int = Field(default=32, ge=1, le=4096,
                                  description="Rows per forward/backward pass; a batch's micro-batches accumulate "
                                              "gradients into one optimizer step (bounds memory, not the maths)")


RUN_KINDS: tuple[type[BaseModel], ...] = (SftRun, OpsdRun, RlRun)


def _run_type(value: Any) -> str:
    """The tag of a run config (dict or model); a config without ``type`` is ``sft``."""
    if isinstance(value, dict):
        return value.get("type", "sft")
    return getattr(value, "type", "sft")


RunKind = Annotated[Annotated[SftRun, Tag("sft")] | Annotated[OpsdRun, Tag("opsd")] | Annotated[RlRun, Tag("rl")],
                    Discriminator(_run_type)]


class LoraSettings(BaseModel):
    """The LoRA adapter trained on the frozen base."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    r: int = Field(default=8, ge=1, le=256, description="LoRA rank")
    alpha: int = Field(default=16, ge=1, le=1024, description="LoRA alpha (scale = alpha / r)")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="Dropout on the LoRA input")
    target_modules: tuple[str, ...] = Field(default=("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1,
                                            description="Module names to adapt (comma-separated on the CLI)")


class TrainerSettings(ServiceSettings):
    """One training run: data, model, optimisation, evaluation, checkpoints and publishing."""

    run: RunKind = Field(default_factory=SftRun, description="What to train (discriminated on type)")
    base_model: str = Field(default=DEFAULT_BASE, min_length=1, max_length=4096,
                            description=f"{DEFAULT_BASE!r} (the embedded GGUF, prepared once) or a "
                                        "Hugging Face model directory")
    output_dir: Path = Field(default=Path("out/train"), description="Run directory: config, metrics.jsonl, "
                                                                   "checkpoints/, adapter/")
    episodes_file: Path | None = Field(default=None, description="Read episodes from this JSONL (the "
                                                                 "`fanroute dataset` format) instead of Kafka")
    as_of: datetime | None = Field(default=None, description="Dataset as of this instant from the episodes "
                                                             "topic (default: now)")
    allow_uncalibrated: bool = Field(default=False, description="Train on episodes whose judge key has no "
                                                                "open calibration gate (recorded in the run)")
    max_steps: int = Field(default=1000, ge=1, le=10_000_000,
                           description="Stop after this many steps (never more than one pass)")
    batch_size: int = Field(default=8, ge=1, le=4096, description="Episodes per optimiser step")
    max_tokens: int = Field(default=512, ge=16, le=131_072,
                            description="Longest example in tokens; longer ones are cut at the end")
    bucket_window: int = Field(default=16, ge=1, le=100_000,
                               description="Batches sorted by length together (1 = random batches)")
    lr: float = Field(default=1e-3, gt=0, le=1, description="Peak learning rate (AdamW); LoRA on one short "
                                                          "pass needs more than the usual 2e-4")
    weight_decay: float = Field(default=0.0, ge=0, le=1, description="AdamW weight decay")
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000, description="Linear warm-up steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="linear", description="Decay after warm-up, over one pass (max_steps only stops early)")
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6, description="Gradient clipping norm")
    micro_batch_tokens: int = Field(
        default=1024, ge=0, le=10_000_000,
        description="SFT: padded tokens (rows × longest) per forward/backward; a larger batch is split and its "
                    "gradients accumulate into the same step (bounds memory, not the maths; 0 = whole batch)")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapter")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed for LoRA init, data order and dropout")
    eval_fraction: float = Field(default=0.1, ge=0, le=0.9,
                                 description="Share of distinct queries held out (by hash of the user turn)")
    eval_every: int = Field(default=50, ge=0, le=10_000_000,
                            description="Evaluate every N steps (0 = only at the end)")
    eval_max_examples: int = Field(default=64, ge=1, le=100_000, description="Held-out episodes evaluated")
    eval_max_new_tokens: int = Field(default=48, ge=1, le=1024, description="Greedy tokens per answer")
    route_cost_weight: float = Field(default=0.0, ge=0, le=1e6,
                                     description="λ of the routing eval's decision (quality per USD), as the "
                                                 "gateway's routing.cost_weight")
    route_costs: str = Field(
        default="", max_length=4096, pattern=r"^([A-Za-z0-9._-]+=[0-9.eE+-]+(,[A-Za-z0-9._-]+=[0-9.eE+-]+)*)?$",
        description="Cost per call in USD the routing eval prices each provider at, 'name=usd,...' (the "
                    "gateway's providers' cost_usd; empty: every provider free)")
    grades_source: Literal["auto", "verdicts", "ordering"] = Field(
        default="auto", description="Judge grades for eval: verdicts topic, or tier ranks of the episode's "
                                    "ordering (auto: verdicts when reading Kafka, ordering for a file)")
    checkpoint_every: int = Field(default=50, ge=0, le=10_000_000,
                                  description="Checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Newest checkpoints kept")
    resume: bool = Field(default=False, description="Continue from the newest checkpoint in output_dir")
    init_adapter: Path | None = Field(default=None, description="Start from this published adapter directory")
    publisher_url: str | None = Field(default=None, min_length=1, max_length=2048,
                                      description="Publish the adapter here when done (default: skip)")
    model_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
                                 description="Id to publish under (default: the output directory's name)")
    dry_run: bool = Field(default=False, description="Validate, resolve and print config and data counts; "
                                                     "train nothing")
    threads: int = Field(default=0, ge=0, le=512, description="torch CPU threads (0 = torch's default)")

    @property
    def publish_id(self) -> str:
        """The model id the adapter is published under."""
        return self.model_id or self.output_dir.resolve().name

    @property
    def route_cost_table(self) -> dict[str, float]:
        """``route_costs`` as provider → USD per call."""
        pairs = (item.split("=", 1) for item in self.route_costs.split(",") if item)
        return {name: float(usd) for name, usd in pairs}

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run it continues."""
        keep = self.model_dump(mode="json", exclude=RESUMABLE_CHANGES)
        return keep


#: Settings a resume may change: they steer how long and how visibly a run goes, not what it learns.
RESUMABLE_CHANGES = {"max_steps", "micro_batch_tokens", "resume", "dry_run", "eval_every", "eval_max_examples", "eval_max_new_tokens",
                     "route_cost_weight", "route_costs",
                     "checkpoint_every", "keep_checkpoints", "publisher_url", "model_id", "threads", "log_level",
                     "kafka", "redis", "output_dir", "grades_source", "as_of", "episodes_file"}

# ----------------------------------------------------------------------------- command-line flags

_PREFIX = "cfg."
_ENV_ONLY = {"kafka", "redis"}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _plain(annotation: Any) -> Any:
    """``X`` from ``X | None``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _add_flag(group: argparse._ArgumentGroup, flag: str, dest: str, field: Any) -> None:
    """One flag for one scalar field; its help is the field's description."""
    kind = _plain(field.annotation)
    default = field.default if field.default_factory is None else field.default_factory()
    help_ = field.description if "default" in field.description else f"{field.description} (default {default})"
    kw: dict[str, Any] = {"dest": _PREFIX + dest, "default": argparse.SUPPRESS, "help": help_,
                          "metavar": dest.rsplit(".", 1)[-1].upper()}
    if kind is bool:
        del kw["metavar"]
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        return
    if typing.get_origin(kind) is Literal:
        kw["choices"], kw["metavar"] = typing.get_args(kind), None
    elif typing.get_origin(kind) is tuple:
        kw["type"], kw["metavar"] = _csv, "A,B"
    elif kind is datetime:
        kw["type"] = instant
    elif kind in (int, float, Path):
        kw["type"] = kind
    group.add_argument(flag, **kw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per setting: ``--batch-size``, ``--lora-r``, ``--kind`` and the run kinds' own fields."""
    main = parser.add_argument_group("run")
    for name, field in TrainerSettings.model_fields.items():
        if name in _ENV_ONLY:
            continue
        if name == "run":
            kinds = parser.add_argument_group("run kind", "--kind and the fields of each kind")
            kinds.add_argument("--kind", dest=_PREFIX + "run.type", default=argparse.SUPPRESS,
                               choices=[k.model_fields["type"].default for k in RUN_KINDS], help="Run kind")
            seen = {"type"}
            for kind in RUN_KINDS:
                for sub, f in kind.model_fields.items():
                    if sub not in seen:
                        seen.add(sub)
                        _add_flag(kinds, "--" + sub.replace("_", "-"), f"run.{sub}", f)
        elif name == "lora":
            lora = parser.add_argument_group("LoRA")
            for sub, f in LoraSettings.model_fields.items():
                _add_flag(lora, f"--lora-{sub.replace('_', '-')}", f"lora.{sub}", f)
        else:
            _add_flag(main, "--" + name.replace("_", "-"), name, field)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, as a nested dict of settings."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith(_PREFIX):
            continue
        *parents, leaf = key[len(_PREFIX):].split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def settings_from_args(args: argparse.Namespace) -> TrainerSettings:
    """Env settings with the given flags on top (raises pydantic's ValidationError when invalid)."""
    return TrainerSettings(**overrides_from_args(args))
