"""``fanroute chain`` without training: the demo directory it needs, the split by query of episodes and
replay tasks (no held-out query reaches a training stage), bad flags refused with exit 2, the table."""

from __future__ import annotations

import pytest

from services.common.dataset import write_jsonl
from services.episodes.tasks import build_task, write_task
from services.common.adapter_files import RATES_FILE
from services.tools.chain import ChainInputError, load_demo, render
from tests.support.records import NOW, episode, judged_trace, verdict_for

PROVIDERS = ("bm25-all", "dense-all", "eng-bm25", "lib-bm25")


def _demo(tmp_path, *, with_adapter: bool = True, with_table: bool = True):
    demo = tmp_path / "demo"
    eps = [episode(q, "bm25-all > eng-bm25", PROVIDERS, f"e-{i}", trace_id=f"t-{i}")
           for i, q in enumerate(["wing flutter", "protein folding", "lunar regolith"])]
    write_jsonl(eps[:2], demo / "train" / "episodes.jsonl")
    write_jsonl(eps, demo / "episodes" / "episodes.jsonl")
    (demo / "eval").mkdir(parents=True)
    (demo / "eval" / "traces.jsonl").write_text("")
    if with_adapter:
        (demo / "train" / "run" / "adapter").mkdir(parents=True)
        if with_table:
            (demo / "train" / "run" / "adapter" / RATES_FILE).write_text("{}")
    for i, q in enumerate(["wing flutter", "protein folding", "lunar regolith"]):
        trace = judged_trace(f"t-{i}").model_copy(update={"query": q})
        write_task(build_task(trace, verdict_for(f"t-{i}"), now=NOW), demo / "tasks")
    # a held-out trace whose query is also a training query: its task may not be a held-out eval task
    twin = judged_trace("t-9").model_copy(update={"query": "Wing  flutter"})
    write_task(build_task(twin, verdict_for("t-9"), now=NOW), demo / "tasks")
    write_jsonl([*eps, episode("Wing  flutter", "bm25-all", PROVIDERS, "e-9", trace_id="t-9")],
                demo / "episodes" / "episodes.jsonl")
    return demo


def test_an_unfinished_demo_directory_names_what_is_missing(tmp_path):
    with pytest.raises(ChainInputError, match=r"missing SFT adapter .*run `make demo`"):
        load_demo(_demo(tmp_path, with_adapter=False))


def test_an_adapter_without_its_top_tier_table_is_refused_before_any_stage_runs(tmp_path):
    """Every stage is asked with the SFT adapter's table (the demo's decision): without it, no eval could."""
    with pytest.raises(ChainInputError, match=r"missing its table \(.*top_tier_rates.json\)"):
        load_demo(_demo(tmp_path, with_table=False))


def test_episodes_and_tasks_are_split_by_the_demos_training_queries(tmp_path):
    data = load_demo(_demo(tmp_path))
    assert sorted(ep.trace_id for ep in data.held_episodes) == ["t-2", "t-9"]
    assert sorted(t.trace_id for t in data.train_tasks) == ["t-0", "t-1"]
    assert [t.trace_id for t in data.held_tasks] == ["t-2"]  # t-9 asks a training query: not held out


@pytest.mark.parametrize(("flags", "says"), [
    (["--opsd-steps", "0"], "--opsd-steps: must be >= 1"),
    (["--rl-lr", "-1"], "--rl-lr: must be > 0"),
    (["--stages", "opsd,ppo"], "unknown stage(s) ['ppo']"),
    (["--rl-reward", "bleu"], "invalid choice: 'bleu'"),
])
def test_bad_chain_flags_exit_2_naming_the_flag(flags, says, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["chain", *flags])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_missing_demo_is_exit_2_with_the_reason(tmp_path, capsys):
    from services.cli import main

    assert main(["chain", "--demo-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a finished demo" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_table_puts_each_stage_beside_its_interval_to_sft():
    rows = [{"stage": "sft", "human_ndcg10": 0.49, "judge": 1.8, "cost_per_query_usd": 0.0012,
             "vs_sft_human": {"mean": 0.0, "ci95": (0.0, 0.0), "n": 196}, "parse_rate": 1.0,
             "agree_judge_oracle": 0.7},
            {"stage": "sft→opsd", "human_ndcg10": 0.50, "judge": 1.82, "cost_per_query_usd": 0.0012,
             "vs_sft_human": {"mean": 0.01, "ci95": (-0.01, 0.03), "n": 196},
             "vs_sft_judge": {"mean": 0.02, "ci95": None, "n": 196}, "parse_rate": 0.99, "agree_judge_oracle": 0.72,
             "trainer": {"test_first": {"test/ndcg": 0.88, "step": 0}, "test_last": {"test/ndcg": 0.9, "step": 24}}},
            {"stage": "linear", "human_ndcg10": 0.47, "judge": 1.7, "cost_per_query_usd": 0.0013, "baseline": True}]
    text = render(rows)
    assert "| **sft→opsd** | 0.500 | +0.010 [-0.010, +0.030] | 1.82 | +0.020 [—, —] | $0.00120 | 0.99 | 72% | nDCG 0.880 → 0.900 (step 24) |" in text
    assert "| *linear* | 0.470 |" in text


async def test_every_stage_is_evaluated_as_the_demos_routed_gateway_asks(tmp_path, monkeypatch):
    """The chain's SFT row must be the demo's own evaluation of that adapter: same mode, decision, λ, timeout."""
    import contextlib

    import services.evaluate.run as run_mod
    import services.sampler.app as sampler_app
    import services.trainer.sampler_client as client_mod
    from services.tools import chain
    from services.tools.demo_loop import LoopOptions

    @contextlib.asynccontextmanager
    async def fake_served(app, port, **_):
        yield f"http://127.0.0.1:{port}"

    class FakeClient:
        def __init__(self, url):
            self.loaded = []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def load_adapter(self, name, path):
            self.loaded.append(name)

    asked = []

    async def fake_run_eval(opts, judge):
        asked.append(opts)
        return opts.candidate

    monkeypatch.setattr(chain, "served", fake_served)
    monkeypatch.setattr(sampler_app, "create_app", lambda settings: None)
    monkeypatch.setattr(client_mod, "SamplerClient", FakeClient)
    monkeypatch.setattr(run_mod, "run_eval", fake_run_eval)
    data = chain.load_demo(_demo(tmp_path))
    reports = await chain.routed_evals(data, tmp_path, {"sft": tmp_path, "rl": tmp_path},
                                       chain.ChainOptions(out_dir=tmp_path / "out"), print)
    demo = LoopOptions()
    assert set(reports) == {"sft", "rl"} and len(asked) == 2
    for opts in asked:
        assert (opts.router_mode, opts.decision, opts.cost_weight, opts.router_timeout_s, opts.router_max_tokens) == (
            demo.router_mode, demo.decision, demo.cost_weight, demo.router_timeout_s, demo.router_max_tokens)
    assert demo.router_mode == "first-token" and demo.cost_weight > 0  # not the gateway's bare defaults
