"""Run kind ``opsd``: on-policy self-distillation of the router against its own hinted self.

Why: SFT trains on recorded text; OPSD trains on what the *current* adapter samples, so there is no
exposure bias between training and serving. Per step, for G episodes: the sampler (over HTTP) samples
``group_size`` orderings of each student prompt from the adapter being trained; the same adapter
scores those tokens after the teacher's hinted prompt (``prompt_logprobs``), re-aligned to the
completion positions; the per-token advantage is ``-(log p_student - log q_teacher)·kl_penalty_coef``
with the sampler's recorded logprobs as ``log p_student``; one policy-gradient step
(:mod:`services.trainer.losses`) runs on those advantages; the new weights go back to the sampler
(published, so the sampler pulls them, or loaded directly when no publisher is configured) before
the next batch is sampled. At most one pass: N episodes, G per step, ceil(N/G) steps.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas.adapter import versioned_name
from schemas.episode import Episode
from services.common.errors import ConfigError
from services.models.prepare import resolve_base
from services.trainer import checkpoint as ckpt
from services.trainer.data import (
    GateLookup,
    batch_order,
    check_gates,
    episode_judge,
    judge_keys,
    kafka_gate_lookup,
    select,
    split_by_query,
)
from services.trainer.evaluate import (
    GradesFor,
    eval_items,
    evaluate,
    load_kafka_grades,
    score,
)
from services.trainer.opsd_data import PromptRow, build_rows
from services.trainer.policy import completion_logprobs, padded, policy_step
from services.trainer.sampler_client import Sample, SamplerClient
from services.trainer.settings import OpsdRun, TrainerSettings
from services.trainer.train import (
    DivergedError,
    MetricsLog,
    Out,
    Plan,
    Publisher,
    PublishError,
    RunResult,
    _from_kafka,
    _print,
    _save_adapter,
    inherited_rates,
    build_model,
    build_optimizer,
    load_dataset,
    publisher_for,
)

SERVED = "served"


def _grades_for(s: TrainerSettings, episodes: Sequence[Episode], given: GradesFor | None) -> GradesFor | None:
    """Grades of the sampled orderings: injected, the verdicts topic, or None (tier ranks of the ordering)."""
    if given is not None or s.grades_source == "ordering" or (s.grades_source == "auto" and s.episodes_file):
        return given
    wanted = {ep.trace_id: key for ep in episodes
              if ep.trace_id and (key := episode_judge(ep, s.run.reward_name)) is not None}
    return _from_kafka(lambda: load_kafka_grades(s.kafka, wanted), "verdicts", s) if wanted else None


def plan_opsd(settings: TrainerSettings, *, episodes: Sequence[Episode] | None = None,
              gate_lookup: GateLookup | None = None, grades_for: GradesFor | None = None) -> tuple[Plan, GradesFor | None]:
    """Load, filter by ``min_reward``, gate, split, render the prompt rows, order the one pass. No weights."""
    import asyncio

    run = settings.run
    assert isinstance(run, OpsdRun)
    found, source = load_dataset(settings, episodes)
    selection = select(found, run.reward_name, run.min_reward, None)
    if gate_lookup is None and not (settings.allow_uncalibrated and settings.episodes_file is not None):
        wanted = judge_keys(selection.kept, run.reward_name)
        gate_lookup = _from_kafka(lambda: asyncio.run(kafka_gate_lookup(settings.kafka, wanted)),
                                  "calibration gates", settings)
    gates = check_gates(selection.kept, run.reward_name, gate_lookup, settings.allow_uncalibrated)
    train_eps, eval_eps = split_by_query(selection.kept, settings.eval_fraction)
    if not train_eps:
        raise ConfigError(f"eval_fraction {settings.eval_fraction} holds out every one of the "
                          f"{len(selection.kept)} selected episodes; nothing is left to train on")
    counts: dict[str, Any] = dict(selection.counts) | {"reward": selection.reward, "min_reward": run.min_reward,
                                                       "train_episodes": len(train_eps),
                                                       "eval_episodes": len(eval_eps)}
    base_dir = resolve_base(settings.base_model, prepare=not settings.dry_run)
    plan = Plan(settings, source, counts, gates, train_eps, eval_eps[:settings.eval_max_examples], base_dir)
    if not (base_dir / "tokenizer_config.json").is_file():
        counts["tokens"] = f"not counted: {base_dir} is not prepared (fanroute models prepare)"
        return plan, grades_for
    from transformers import AutoTokenizer

    grades = _grades_for(settings, list(train_eps) + list(plan.eval_episodes), grades_for)
    plan.tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows, row_counts = build_rows(plan.tokenizer, train_eps, run, grades, settings.max_tokens)
    counts.update(row_counts)
    if not rows:
        raise ConfigError(f"max_tokens {settings.max_tokens} leaves no room for {run.max_new_tokens} new tokens "
                          "after any teacher prompt")
    plan.examples = rows  # type: ignore[assignment]  # the one-pass rule and the data fingerprint read ids
    plan.batches = batch_order([len(r.student_ids) for r in rows], settings.batch_size, settings.bucket_window,
                               settings.seed)
    counts["samples_per_step"] = settings.batch_size * run.group_size
    return plan, grades


# ----------------------------------------------------------------------------- weights on the sampler


class SamplerWeights:
    """Puts the trainer's current adapter where the sampler samples from: the publisher, or a direct load."""

    def __init__(self, s: TrainerSettings, sampler: SamplerClient, publisher: Publisher | None) -> None:
        self.s, self.sampler, self.publisher = s, sampler, publisher
        self.root = s.output_dir / SERVED
        self.loaded: str | None = None

    def push(self, model: Any, step: int, metrics: dict[str, float]) -> tuple[str, int]:
        """Save the adapter after ``step`` and serve it; the model name to sample from and its version."""
        target = _save_adapter(model, self.root / f"step_{step}")
        for old in sorted(self.root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        if self.publisher is not None:
            try:
                published = self.publisher.publish(self.s.publish_id, target, self.s.base_model, metrics)
            except Exception as exc:  # any client error: the run stops, its checkpoints stay
                raise PublishError(f"step {step}: publishing {self.s.publish_id} failed: {exc}") from exc
            version = int(published["version"])
            return versioned_name(self.s.publish_id, version), version
        name = versioned_name(self.s.publish_id, step + 1)
        self.sampler.load_adapter(name, str(target.resolve()))
        if self.loaded is not None and self.loaded != name:
            self.sampler.unload_adapter(self.loaded)
        self.loaded = name
        return name, step + 1


# ----------------------------------------------------------------------------- one step


def _seed(base: int, step: int, row: int, g: int) -> int:
    return (base * 1_000_003 + step * 10_007 + row * 101 + g) % (2**31 - 1)


def eot_ids(tokenizer: Any) -> frozenset[int]:
    """The end-of-turn token ids: the tokenizer's eos and ChatML's ``<|im_end|>`` where it has one."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return frozenset(i for i in ids if i is not None)


def shaped_advantages(run: OpsdRun, sampled: Sequence[Sequence[int]], sampler_lp_BC: Any, teacher_lp_BC: Any,
                      reference_lp_BC: Any | None, mask_BC: Any, eot: frozenset[int]) -> tuple[Any, dict[str, float]]:
    """Per-token advantages: -coef·(log p - log q_teacher), the anchor's -anchor_coef·(log p - log p_start),
    and (``protect_eot``) no negative advantage on an end-of-turn token; with their own metrics."""
    import torch

    reverse_kl_BC = (sampler_lp_BC - teacher_lp_BC) * mask_BC
    adv_BC = -reverse_kl_BC * run.kl_penalty_coef
    n_tok = max(float(mask_BC.sum()), 1.0)
    extra: dict[str, float] = {}
    if reference_lp_BC is not None:
        anchor_BC = (sampler_lp_BC - reference_lp_BC) * mask_BC
        extra["kl_start"] = float(anchor_BC.sum()) / n_tok
        if run.anchor_coef > 0:
            adv_BC = adv_BC - anchor_BC * run.anchor_coef
    if run.protect_eot and eot:
        is_eot_BC = torch.zeros_like(mask_BC, dtype=torch.bool)
        for b, toks in enumerate(sampled):
            for c, t in enumerate(toks):
                if t in eot:
                    is_eot_BC[b, c] = True
        pushed_down = is_eot_BC & (adv_BC < 0)
        extra["eot_protected"] = float(pushed_down.sum())
        adv_BC = torch.where(pushed_down, torch.zeros_like(adv_BC), adv_BC)
    return adv_BC * mask_BC, {"kl": float(reverse_kl_BC.sum()) / n_tok,
                              "kl_per_sequence": float(reverse_kl_BC.sum()) / max(len(sampled), 1)} | extra


def opsd_step(s: TrainerSettings, model: Any, optimizer: Any, scheduler: Any, sampler: SamplerClient,
              served: str, rows: Sequence[PromptRow], step: int, pad_id: int, *, reference: str | None = None,
              eot: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Sample, score with the hint, one policy-gradient step; the step's metrics (see the module docstring).

    ``reference``: the starting adapter's served name; with ``teacher=frozen`` it scores the hinted prompt,
    and it scores the student's own prompt for the anchor (and the ``kl_start`` metric)."""
    run = s.run
    assert isinstance(run, OpsdRun)
    t0 = time.perf_counter()
    jobs = [(row, _seed(s.seed, step, i, g)) for i, row in enumerate(rows) for g in range(run.group_size)]

    def draw(job: tuple[PromptRow, int]) -> tuple[PromptRow, Sample]:
        row, seed = job
        return row, sampler.sample(served, row.student_ids, max_tokens=run.max_new_tokens,
                                   temperature=run.temperature, seed=seed)

    if run.sample_concurrency > 1:  # httpx.Client is thread-safe; each request keeps its own seed
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(run.sample_concurrency, len(jobs))) as pool:
            samples = list(pool.map(draw, jobs))
    else:
        samples = [draw(job) for job in jobs]
    t1 = time.perf_counter()
    teacher_name = reference if run.teacher == "frozen" and reference is not None else served
    teacher = sampler.score(teacher_name, [row.teacher_ids + smp.token_ids for row, smp in samples],
                            [len(row.teacher_ids) for row, _ in samples])
    seqs = [row.student_ids + smp.token_ids for row, smp in samples]
    prompt_lens = [len(row.student_ids) for row, _ in samples]
    start_lp = sampler.score(reference, seqs, prompt_lens) if reference is not None else None
    t2 = time.perf_counter()
    model.eval()  # no dropout: the sampler computes without it, and the ratio must compare like with like
    trainer_lp_BC, entropy_BC, mask_BC = completion_logprobs(model, seqs, prompt_lens, pad_id)
    C = mask_BC.shape[1]
    sampler_lp_BC, teacher_lp_BC = padded([smp.logprobs for _, smp in samples], C), padded(teacher, C)
    advantages_BC, kls = shaped_advantages(run, [smp.token_ids for _, smp in samples], sampler_lp_BC, teacher_lp_BC,
                                           padded(start_lp, C) if start_lp is not None else None, mask_BC, eot)
    stepped = policy_step(model, optimizer, scheduler, run.loss, trainer_lp_BC, sampler_lp_BC, advantages_BC, mask_BC,
                          entropy_BC, clip_low=run.clip_low, clip_high=run.clip_high, max_grad_norm=s.max_grad_norm)
    t3 = time.perf_counter()
    n_tok = float(mask_BC.sum())
    scored = [score(smp.text, row.grades) for row, smp in samples]
    trained_tokens = sum(len(x) for x in seqs)
    return stepped | kls | {
        "reward": sum(x[0] for x in scored) / len(scored), "top1": sum(x[1] for x in scored) / len(scored),
        "completion_tokens": n_tok / len(samples),
        "truncated_fraction": sum(smp.finish_reason == "length" for _, smp in samples) / len(samples),
        "samples": len(samples), "tokens": trained_tokens, "tokens_per_s": trained_tokens / (t3 - t2),
        "sample_tokens_per_s": n_tok / (t1 - t0), "sample_time_s": t1 - t0, "score_time_s": t2 - t1,
        "train_time_s": t3 - t2,
    }


# ----------------------------------------------------------------------------- the run

REFERENCE = "reference"


def _load_reference(s: TrainerSettings, model: Any, sampler: SamplerClient, *, fresh: bool, out: Out) -> str | None:
    """The starting adapter on the sampler under its own name (frozen teacher, anchor), or None when neither
    needs it. Saved once, at the run's start, so a resumed run keeps the same reference."""
    run = s.run
    assert isinstance(run, OpsdRun)
    if run.teacher != "frozen" and run.anchor_coef == 0:
        return None
    where = s.output_dir / REFERENCE
    if fresh or not (where / "adapter_config.json").is_file():
        if not fresh:
            raise ConfigError(f"{where} is missing: the run being resumed saved no starting adapter (it was started "
                              "with teacher=live and anchor_coef=0); resume with those, or start afresh")
        _save_adapter(model, where)
    name = versioned_name(f"{s.publish_id}-start", 0)
    sampler.load_adapter(name, str(where.resolve()))
    out(f"starting adapter served as {name} ({'frozen teacher' if run.teacher == 'frozen' else 'live teacher'}"
        f"{f', anchor {run.anchor_coef:g}' if run.anchor_coef else ''})")
    return name



def _fingerprint(s: TrainerSettings, plan: Plan) -> dict[str, Any]:
    keep = s.fingerprint_fields()
    for k in ("sampler_url", "sampler_timeout_s"):
        keep["run"].pop(k, None)
    return json.loads(json.dumps(keep | {"data": plan.data_fingerprint()}))


def train_opsd(settings: TrainerSettings, *, episodes: Sequence[Episode] | None = None,
               gate_lookup: GateLookup | None = None, grades_for: GradesFor | None = None,
               publisher: Publisher | None = None, sampler: SamplerClient | None = None,
               out: Out = _print) -> RunResult:
    """Plan, then (unless dry-run) run the OPSD steps with evaluation, checkpoints and per-step serving."""
    s, output_dir = settings, settings.output_dir
    run = s.run
    assert isinstance(run, OpsdRun)
    plan, grades = plan_opsd(s, episodes=episodes, gate_lookup=gate_lookup, grades_for=grades_for)
    if s.dry_run:
        out(json.dumps(plan.record(), indent=2, sort_keys=True, default=str))
        out(f"dry run: {plan.one_pass_line() if plan.batches else 'tokens not counted'}; nothing trained")
        return RunResult(False, 0, output_dir, plan)
    publisher = publisher if publisher is not None else publisher_for(s)
    latest = ckpt.resumable(output_dir, s.resume)
    output_dir.mkdir(parents=True, exist_ok=True)
    eval_set = eval_items(plan.tokenizer, plan.eval_episodes, grades)

    import torch

    if s.threads:
        torch.set_num_threads(s.threads)
    model = build_model(plan, out)
    optimizer, scheduler = build_optimizer(plan, model)
    fingerprint, start = _fingerprint(s, plan), 0
    if latest is not None:
        ckpt.check_fingerprint(ckpt.read_progress(latest).fingerprint, fingerprint, latest)
        progress = ckpt.load_checkpoint(latest, model, optimizer, scheduler)
        start, plan.batches = progress.step, progress.batches
        if start > plan.steps:
            raise ConfigError(f"{latest} is at step {start}, past max_steps={s.max_steps}")
        out(f"resumed from {latest} at step {start}")
    metrics = MetricsLog(output_dir / "metrics.jsonl", fresh=latest is None)
    (output_dir / "config.json").write_text(json.dumps(plan.record(), indent=2, sort_keys=True, default=str) + "\n")
    metrics.write(plan.record() | {"event": "start", "step": start, "resumed_from": start if latest else None})
    out(plan.one_pass_line() + f"; {run.group_size} samples per prompt, loss {run.loss}")
    pad_id = plan.tokenizer.pad_token_id if plan.tokenizer.pad_token_id is not None else plan.tokenizer.eos_token_id
    sampler = sampler if sampler is not None else SamplerClient(run.sampler_url, run.sampler_timeout_s)
    weights = SamplerWeights(s, sampler, publisher)
    served, version = weights.push(model, start, {"step": float(start)})
    step_of = {version: start}
    out(f"serving step {start} as {served}")
    reference = _load_reference(s, model, sampler, fresh=latest is None, out=out)
    eot = eot_ids(plan.tokenizer)
    final: dict[str, Any] = {}

    def run_eval(step: int) -> None:
        if eval_set:
            scores = evaluate(model, plan.tokenizer, eval_set, s.eval_max_new_tokens)
            metrics.write({"step": step, **scores})
            final.update(scores if step else {f"start/{k}": v for k, v in scores.items()})
            out(f"eval step {step}: ndcg {scores['test/ndcg']:.3f} top1 {scores['test/top1']:.3f} "
                f"parsed {scores['test/parse_ok']:.2f} (n={scores['test/n']})")

    def save(step: int) -> None:
        ckpt.save_checkpoint(output_dir, model, optimizer, scheduler,
                             ckpt.Progress(step, plan.batches, fingerprint), s.keep_checkpoints)

    if start == 0:
        run_eval(0)
    for step in range(start + 1, plan.steps + 1):
        t0 = time.perf_counter()
        rows = [plan.examples[i] for i in plan.batches[step - 1]]
        rec: dict[str, Any] = opsd_step(s, model, optimizer, scheduler, sampler, served, rows, step, pad_id,  # type: ignore[arg-type]
                                        reference=reference, eot=eot)
        if not all(math.isfinite(rec[k]) for k in ("loss", "grad_norm", "kl")):
            metrics.write({"step": step, **rec})
            raise DivergedError(f"step {step}: loss {rec['loss']} / grad norm {rec['grad_norm']} / kl {rec['kl']} "
                                f"is not finite; stopped without publishing (metrics in {output_dir / 'metrics.jsonl'})")
        sampled = version
        t1 = time.perf_counter()
        served, version = weights.push(model, step, {k: float(v) for k, v in rec.items() if isinstance(v, (int, float))})
        step_of[version] = step
        rec |= {"step": step, "epoch": step / plan.steps_per_pass, "sampled_version": sampled,
                "trained_version": version, "staleness": (step - 1) - step_of[sampled],
                "publish_time_s": time.perf_counter() - t1, "step_time_s": time.perf_counter() - t0}
        metrics.write(rec)
        final.update({f"train/{k}": v for k, v in rec.items() if k not in ("step", "epoch")})
        out(f"step {step}/{plan.steps} kl {rec['kl']:.4f} mismatch {rec['mismatch']:.2e} entropy {rec['entropy']:.3f} "
            f"reward {rec['reward']:.3f} loss {rec['loss']:.4f} grad_norm {rec['grad_norm']:.3f} "
            f"tok/s {rec['tokens_per_s']:.0f} sampled v{sampled} -> v{version} (staleness {rec['staleness']}) "
            f"({rec['step_time_s']:.1f}s, {rec['epoch']:.2f} of a pass)")
        ckpt.after_step(step, plan.steps, s.checkpoint_every, s.eval_every, save, run_eval)
    ckpt.at_end(start, plan.steps, save, run_eval)
    adapter_dir = _save_adapter(model, output_dir / "adapter", inherited_rates(s.init_adapter))
    final |= {"steps": plan.steps, "episodes": len(plan.examples), "served": served, "version": version,
              "allow_uncalibrated": s.allow_uncalibrated, "uncalibrated_episodes": plan.uncalibrated_episodes,
              "one_pass_capped": plan.capped}
    metrics.write({"event": "end", "step": plan.steps, **final})
    published = {"model": served, "version": version} if publisher is not None else None
    (output_dir / "summary.json").write_text(json.dumps(
        {"final": final, "adapter_dir": str(adapter_dir), "published": published}, indent=2, sort_keys=True,
        default=str) + "\n")
    out(f"done: {plan.steps} steps, adapter at {adapter_dir}, last served as {served}")
    return RunResult(True, plan.steps, Path(output_dir), plan, adapter_dir, final, published)
