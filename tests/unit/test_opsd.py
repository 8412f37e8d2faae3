"""Run kind opsd on the tiny model against a real CPU sampler over HTTP (loaded directly, no publisher):
hints, bad settings, the sampler client against a direct forward pass, steps, metrics, eval, resume, dry run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.settings import KafkaSettings
from services.trainer.opsd_data import hint_for, hinted_messages
from services.trainer.settings import OpsdRun, TrainerSettings, add_arguments
from tests.support.serving import free_port, served
from tests.support.tiny_model import build_lora_adapter, build_tiny_model
from tests.support.trainer_runs import JUDGE, episode, gate

pytestmark = pytest.mark.slow


def open_gate(key, providers):
    return gate(True)


def test_reward_and_custom_hints():
    ep = episode(1, answer="beta > alpha > gamma", reward=0.75)
    hint = hint_for(ep, OpsdRun())
    assert hint == "Judge's answer (reward 0.75): beta > alpha > gamma"
    assert JUDGE not in hint  # a long reward name makes the teacher want to keep writing (opsd_data.py)
    custom = OpsdRun(hint_mode="custom", hint_template="Best for {query}: {answer} ({reward:.1f}; {providers})")
    assert hint_for(ep, custom) == f"Best for {ep.messages[1].content}: beta > alpha > gamma (0.8; alpha, beta, gamma)"
    msgs = hinted_messages(ep, "HINT")
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == ep.messages[0].content
    assert msgs[1]["content"] == f"HINT\nQuery: {ep.messages[1].content}"


def test_advantages_anchor_to_the_start_and_never_push_the_end_of_turn_down():
    import torch

    from services.trainer.opsd import shaped_advantages

    sampled = [[5, 7, 2], [9, 2]]  # token 2 ends the turn
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    student = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.1, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -2.0, 0.0]])  # the teacher wants the turn to go on
    start = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -0.1, 0.0]])
    plain, m = shaped_advantages(OpsdRun(protect_eot=False), sampled, student, teacher, None, mask, frozenset({2}))
    assert plain.flatten().tolist() == pytest.approx([-0.5, 1.0, -2.5, 0.5, -1.9, 0.0])
    assert m["kl"] == pytest.approx((0.5 - 1.0 + 2.5 - 0.5 + 1.9) / 5) and "kl_start" not in m
    protected, m = shaped_advantages(OpsdRun(), sampled, student, teacher, start, mask, frozenset({2}))
    assert protected.flatten().tolist() == pytest.approx([-0.5, 1.0, 0.0, 0.5, 0.0, 0.0]) and m["eot_protected"] == 2
    assert m["kl_start"] == pytest.approx((0.0 - 1.0 + 0.5 + 1.0 + 0.0) / 5)  # measured even with the anchor off
    anchored, _ = shaped_advantages(OpsdRun(anchor_coef=0.5, protect_eot=False), sampled, student, teacher, start,
                                    mask, frozenset({2}))
    assert anchored.flatten().tolist() == pytest.approx([-0.5, 1.5, -2.75, 0.0, -1.9, 0.0])


@pytest.mark.parametrize(("flags", "says"), [
    (["--group-size", "1"], "group_size"),
    (["--anchor-coef", "-0.1"], "anchor_coef"),
    (["--teacher", "moving"], "argument --teacher: invalid choice: 'moving'"),
    (["--loss", "grpo"], "argument --loss: invalid choice: 'grpo'"),
    (["--hint-mode", "custom"], "hint_mode custom needs a non-empty hint_template"),
    (["--hint-mode", "custom", "--hint-template", " "], "hint_mode custom needs a non-empty hint_template"),
    (["--hint-mode", "custom", "--hint-template", "{nope}"], "hint_template names ['nope']"),
])
def test_bad_settings_are_clear_errors(flags, says, capsys):
    from services.trainer.cli import run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    try:
        code = run(parser.parse_args(["--kind", "opsd", *flags]))
    except SystemExit as exc:  # argparse refuses a choice outside the list itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err, err
    if "group_size" in says:
        assert "greater than or equal to 2" in err
    with pytest.raises(Exception, match="unknown loss|Input should be"):
        TrainerSettings(run={"type": "opsd", "loss": "grpo"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("opsd") / "model")


@contextlib.asynccontextmanager
async def sampler_on(tiny: Path, tmp_path: Path):
    from services.sampler.app import create_app
    from services.sampler.settings import SamplerSettings

    port = free_port()
    settings = SamplerSettings(base_model=str(tiny), port=port, consume_adapters=False,
                               adapter_cache_dir=tmp_path / "cache", kafka=KafkaSettings(bootstrap_servers="memory://"))
    async with served(create_app(settings), port, what="sampler", start_timeout_s=60):
        yield f"http://127.0.0.1:{port}"


def _direct(base: Path, adapter: Path | None, ids: list[int], start: int) -> list[float]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logp_TV[t - 1, ids[t]]) for t in range(start, len(ids))]


async def test_sampler_client_samples_and_scores_like_a_forward_pass(tiny, tmp_path):
    from services.trainer.sampler_client import SamplerClient, SamplerError

    adapter = build_lora_adapter(tiny, tmp_path / "lora", seed=3)
    async with sampler_on(tiny, tmp_path) as url:
        def calls():
            with SamplerClient(url) as c:
                c.load_adapter("router@1", str(adapter))
                prompt = list(range(5, 25))
                smp = c.sample("router@1", prompt, max_tokens=6, seed=1)
                scored = c.score("router@1", [prompt + list(smp.token_ids), prompt[:7] + list(smp.token_ids)],
                                 [len(prompt), 7])
                with pytest.raises(SamplerError, match="HTTP 404"):
                    c.sample("router@9", prompt, max_tokens=2)
                return prompt, smp, scored

        prompt, smp, scored = await asyncio.to_thread(calls)
    ids = prompt + list(smp.token_ids)
    assert len(smp.token_ids) == len(smp.logprobs) > 0
    assert list(smp.logprobs) == pytest.approx(_direct(tiny, adapter, ids, len(prompt)), abs=1e-4)
    assert scored[0] == pytest.approx(list(smp.logprobs), abs=1e-4)
    other = prompt[:7] + list(smp.token_ids)
    assert scored[1] == pytest.approx(_direct(tiny, adapter, other, 7), abs=1e-4)


def _settings(tiny: Path, out: Path, url: str, **kw) -> TrainerSettings:
    base = {"base_model": str(tiny), "output_dir": out, "allow_uncalibrated": True, "batch_size": 2, "max_steps": 3,
            "max_tokens": 512, "eval_every": 2, "eval_fraction": 0.3, "eval_max_new_tokens": 12,
            "checkpoint_every": 1, "grades_source": "ordering", "lora": {"dropout": 0.05}, "lr": 5e-3,
            "kafka": KafkaSettings(bootstrap_servers="memory://"),
            "run": {"type": "opsd", "sampler_url": url, "max_new_tokens": 10, "group_size": 2,
                    "sample_concurrency": 1}}  # one at a time: the resumed run must sample the same tokens
    return TrainerSettings(**(base | kw))


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


async def test_opsd_steps_serve_each_adapter_and_log_the_metrics(tiny, tmp_path):
    from services.trainer.opsd import train_opsd

    eps = [episode(i, reward=1.0 if i % 5 else 0.2) for i in range(12)]
    lines: list[str] = []
    from services.trainer.sampler_client import SamplerClient

    scored_by: list[str] = []

    class Recording(SamplerClient):
        def score(self, model, sequences, starts):
            scored_by.append(model)
            return super().score(model, sequences, starts)

    async with sampler_on(tiny, tmp_path) as url:
        s = _settings(tiny, tmp_path / "run", url)
        result = await asyncio.to_thread(train_opsd, s, episodes=eps, gate_lookup=open_gate, out=lines.append,
                                         sampler=Recording(url))
        assert result.trained and result.steps == 3
        # resume: a second run from the step-2 checkpoint trains the same third step
        part = _settings(tiny, tmp_path / "part", url, max_steps=2)
        await asyncio.to_thread(train_opsd, part, episodes=eps, gate_lookup=open_gate, out=lines.append)
        resumed = await asyncio.to_thread(train_opsd, _settings(tiny, tmp_path / "part", url, resume=True),
                                          episodes=eps, gate_lookup=open_gate, out=lines.append)
        dry = await asyncio.to_thread(train_opsd, _settings(tiny, tmp_path / "dry", url, dry_run=True),
                                      episodes=eps, gate_lookup=open_gate, out=lines.append)
        batched = _settings(tiny, tmp_path / "batched", url, max_steps=1, eval_every=0)
        batched = batched.model_copy(update={"run": batched.run.model_copy(update={"sample_concurrency": 4})})
        await asyncio.to_thread(train_opsd, batched, episodes=eps, gate_lookup=open_gate, out=lines.append)
    [one] = [r for r in _records(tmp_path / "batched") if "kl" in r]  # four samples in flight, decoded as a batch
    assert one["samples"] == 4 and one["mismatch"] < 1e-4
    plan = result.plan
    assert plan.counts["dropped/below_min"] == 3 and plan.counts["samples_per_step"] == 4  # min_reward 0.5
    steps = [r for r in _records(tmp_path / "run") if "kl" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [(r["sampled_version"], r["trained_version"], r["staleness"]) for r in steps] == [(1, 2, 0), (2, 3, 0),
                                                                                              (3, 4, 0)]
    for r in steps:
        assert r["mismatch"] < 1e-4  # fp32 on both sides, no dropout in the trainer's forward
        assert r["samples"] == 4 and r["kl"] == r["kl"] and r["entropy"] > 0 and 0 <= r["reward"] <= 1
        assert r["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert any(abs(r["kl"]) > 1e-3 for r in steps)  # the hint moves the teacher
    # the frozen teacher: every score call (hinted prompt, then the anchor's own prompt) asks the starting adapter
    assert set(scored_by) == {"run-start@0"} and len(scored_by) == 6
    assert (tmp_path / "run" / "reference" / "adapter_config.json").is_file()
    assert abs(steps[0]["kl_start"]) < 1e-4 < abs(steps[2]["kl_start"])  # step 1 samples the start itself
    evals = [r for r in _records(tmp_path / "run") if "test/ndcg" in r and "event" not in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert any("one pass over" in ln for ln in lines) and any(ln.startswith("step 3/3 kl") for ln in lines)
    again = [r for r in _records(tmp_path / "part") if "kl" in r]
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["kl"] == pytest.approx(steps[2]["kl"], abs=1e-5)
    import torch
    from safetensors.torch import load_file

    a = load_file(result.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert not dry.trained and any(ln.startswith("dry run: one pass over") for ln in lines)


def test_opsd_without_room_for_completions_is_a_clear_error(tiny, tmp_path):
    from services.trainer.opsd import plan_opsd

    s = _settings(tiny, tmp_path / "x", "http://127.0.0.1:9", max_tokens=16)
    with pytest.raises(ConfigError, match="leaves no room"):
        plan_opsd(s, episodes=[episode(i) for i in range(4)], gate_lookup=open_gate)
