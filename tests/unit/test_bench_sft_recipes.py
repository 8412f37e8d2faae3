"""bench/sft_recipes: the recipes this round added (tie smoothing, a short system prompt) map onto settings and
episodes the way the table says."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.prompt import providers_of
from tests.support.records import episode

PROVIDERS = ("aero", "biomed", "web-lexical")


def test_tie_smooth_is_a_trainer_setting_and_short_prompt_only_rewrites_the_system_turn(tmp_path: Path):
    from bench.sft_recipes import SHORT_TEMPLATE, settings_for, short_prompt

    fit = tmp_path / "fit.jsonl"
    assert settings_for("tie-smooth", fit, tmp_path, None, 1).run.tie_smoothing == 0.3
    assert settings_for("short-prompt", fit, tmp_path, None, 1).run.tie_smoothing == 0.0  # not a trainer field
    ep = episode("supersonic wing", "aero = web-lexical > biomed", PROVIDERS, ep_id="e1")
    [short] = short_prompt([ep])
    system = next(m.content for m in short.messages if m.role == "system")
    assert system == SHORT_TEMPLATE.format(names="aero, biomed, web-lexical")
    assert len(system) < len(next(m.content for m in ep.messages if m.role == "system")) / 2
    assert providers_of(short) == providers_of(ep) == PROVIDERS  # the renderer still reads the provider list
    assert [m for m in short.messages if m.role != "system"] == [m for m in ep.messages if m.role != "system"]
    assert short.episode_id == ep.episode_id


def test_rows_pick_as_the_gateway_does():
    """λ and the top-tier table move the pick exactly as the gateway's decide() would."""
    from bench.routed_eval import gateway_picks

    probs = {"e1": {"aero": 0.55, "web-lexical": 0.45}}
    cost = {"aero": 0.001, "web-lexical": 0.003}
    assert gateway_picks(probs, cost, 0.0, None) == {"e1": "aero"}
    # unsure between labels whose top tier both hold the generalist: the top-tier decision picks it at λ = 0
    rates = {"aero": {"aero": 1.0, "web-lexical": 0.9}, "web-lexical": {"web-lexical": 1.0}}
    assert gateway_picks(probs, cost, 0.0, rates) == {"e1": "web-lexical"}
    assert gateway_picks(probs, cost, 300.0, rates) == {"e1": "aero"}  # ... and λ prices it out


@pytest.mark.parametrize("flag, value, says", [("--cost-weight", "-1", "0..1e+06"), ("--cost-weight", "abc", "not a number"),
                                               ("--passes", "0", "1..100"), ("--val-fraction", "1.5", "0.01..0.9"),
                                               ("--ensemble", "0.5,2", "0..1"), ("--ensemble", "half", "0..1")])
def test_a_bad_number_is_refused_naming_the_flag(tmp_path: Path, capsys, flag: str, value: str, says: str):
    from bench.sft_recipes import main

    with pytest.raises(SystemExit) as exit_:
        main(["--episodes", str(tmp_path / "e.jsonl"), "--traces", str(tmp_path / "t.jsonl"), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and says in err


def _tiny_inputs(tmp_path: Path, monkeypatch, n: int) -> None:
    """``n`` adi traces and their episodes (episodes.jsonl, traces.jsonl in ``tmp_path``) and a tiny base model."""
    from services.common.dataset import write_jsonl
    from tests.support.records import adi, adi_trace, episode
    from tests.support.tiny_model import build_tiny_model
    traces = [adi_trace(q) for q in sorted(adi()[0], key=int)[:n]]
    eps = [episode(t.query, "good > cheap = flaky" if i % 3 else "cheap > good > flaky", ["cheap", "flaky", "good"],
                   ep_id=f"e{i}", trace_id=t.trace_id) for i, t in enumerate(traces)]
    write_jsonl(eps, tmp_path / "episodes.jsonl")
    (tmp_path / "traces.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in traces))
    monkeypatch.setenv("FANROUTE_BASE_MODEL", str(build_tiny_model(tmp_path / "tiny", context=1024)))


def test_a_tiny_run_scores_every_pass_and_runs_again_in_the_same_work_dir(tmp_path: Path, monkeypatch):
    """Rows for the baselines and each pass, decided as the gateway decides; a second run in the same work
    directory trains afresh (it used to refuse the last run's checkpoints) and gives the same figures."""
    import json

    from bench.sft_recipes import main

    _tiny_inputs(tmp_path, monkeypatch, 24)
    reports = []
    for name in ("first.json", "again.json"):
        out = tmp_path / name
        assert main(["--episodes", str(tmp_path / "episodes.jsonl"), "--traces", str(tmp_path / "traces.jsonl"),
                     "--recipes", "first", "--passes", "2", "--work-dir", str(tmp_path / "work"), "--ensemble", "0,1",
                     "--out", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    rep = reports[0]
    assert (rep["decision"], rep["cost_weight"]) == ("top-tier", 150.0)
    passes = [r for r in rep["rows"] if r["policy"] == "first"]
    assert [r["pass"] for r in passes] == [1, 2]
    mixed = {r["w_lm"]: r for r in rep["rows"] if "w_lm" in r}
    assert sorted(mixed) == [0.0, 1.0] and mixed[1.0]["pass"] == 2
    linear = next(r for r in rep["rows"] if r["policy"] == "linear router")
    for key in ("ndcg10", "agree", "shares"):  # all weight on one router: that router's row
        assert mixed[1.0][key] == passes[-1][key] and mixed[0.0][key] == linear[key]
    assert all(0.0 <= r["ndcg10"] <= 1.0 and r["cost"] > 0 for r in rep["rows"])
    drop = ("train_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in reports[1]["rows"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in rep["rows"]]


def test_draws_are_seeded_apart_and_averaged_adapters_get_their_rows(tmp_path: Path, monkeypatch):
    """``--draws 2 --average-passes 1,2 --soup``: each draw's passes, an averaged row per draw after its pass 2,
    and one row for the draws averaged; draw 0 keeps the seeds of a one-draw run, draw 1 trains another adapter."""
    import json

    from bench.sft_recipes import main

    _tiny_inputs(tmp_path, monkeypatch, 16)
    out, work = tmp_path / "r.json", tmp_path / "work"
    assert main(["--episodes", str(tmp_path / "episodes.jsonl"), "--traces", str(tmp_path / "traces.jsonl"),
                 "--recipes", "first", "--passes", "2", "--draws", "2", "--average-passes", "1,2", "--soup",
                 "--work-dir", str(work), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["draw"], r["pass"]) for r in rows if r["policy"] == "first"] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    averaged = [r for r in rows if r["policy"] == "first, passes 1+2 averaged"]
    assert [(r["draw"], r["pass"]) for r in averaged] == [(0, 2), (1, 2)]
    soup = [r for r in rows if r["policy"] == "first, 2 draws averaged"]
    assert len(soup) == 1 and soup[0]["pass"] == 2
    w0 = (work / "first" / "pass2" / "adapter" / "adapter_model.safetensors").read_bytes()
    w1 = (work / "first" / "draw1" / "pass2" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert w0 != w1
    assert json.loads((work / "first" / "soup" / "adapter_config.json").read_text())["r"] == 16  # 2 × the default 8


def test_a_shallower_base_is_the_first_layers_of_the_base_and_its_recipes_name_it(tmp_path: Path):
    """``layers-*`` recipes: the copy keeps the first N decoder layers (its logits are the full model's
    hidden state after layer N through the same norm and output layer), is built once, refuses a depth it
    cannot cut, and the trainer is given the copy with the recipe's LoRA."""
    import torch

    from bench.routed_eval import truncated_base
    from bench.sft_recipes import settings_for
    from services.models.load import load_causal_lm
    from tests.support.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "tiny", layers=3)
    cut = truncated_base(base, 2, tmp_path / "bases" / "L2")
    full, short = load_causal_lm(base, torch.float32), load_causal_lm(cut, torch.float32)
    assert short.config.num_hidden_layers == 2 and len(short.model.layers) == 2
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        after_two = full(ids, output_hidden_states=True).hidden_states[2]
        assert torch.allclose(short(ids).logits, full.lm_head(full.model.norm(after_two)), atol=1e-5)
    stamp = (cut / "config.json").stat().st_mtime_ns
    assert truncated_base(base, 2, cut) == cut and (cut / "config.json").stat().st_mtime_ns == stamp  # built once
    for bad in (0, 3):
        with pytest.raises(ValueError, match="layers must be in 1..2"):
            truncated_base(base, bad, tmp_path / "bases" / f"L{bad}")
    s = settings_for("layers-20-mlp", tmp_path / "fit.jsonl", tmp_path, None, 1, str(cut))
    assert s.base_model == str(cut) and s.lora.r == 16 and "down_proj" in s.lora.target_modules
    assert settings_for("first", tmp_path / "fit.jsonl", tmp_path, None, 1).lora.r == 8  # the default is untouched
