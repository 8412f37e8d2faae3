"""The demo's own logic: the held-out split, the routed-traffic summary, and its CLI refusals."""

from __future__ import annotations

from pathlib import Path

import json
from types import SimpleNamespace

import pytest

from schemas.trace import Route
from services.cli import main
from services.tools.demo_loop import held_out, render_routed, split
from tests.support.records import adi, adi_trace, episode, trace


def test_held_out_is_deterministic_and_about_the_fraction():
    ids = [f"cranfield/{i}" for i in range(4000)]
    share = sum(held_out(q, 0.3) for q in ids) / len(ids)
    assert 0.27 < share < 0.33
    assert [held_out(q, 0.3) for q in ids] == [held_out(q, 0.3) for q in ids]
    assert not any(held_out(q, 0.0) for q in ids) and all(held_out(q, 1.0) for q in ids)


def test_split_never_trains_on_a_held_out_query(tmp_path):
    queries, _, _ = adi()
    traces = [adi_trace(q) for q in sorted(queries, key=int)]
    episodes = [episode(t.query, "good > cheap = flaky", ["good", "cheap", "flaky"], ep_id=f"e-{t.trace_id}")
                .model_copy(update={"trace_id": t.trace_id}) for t in traces]
    data = split(traces, episodes, 0.3, tmp_path)
    held = {t.query for t in data.held_out}
    trained = [json.loads(line)["messages"][1]["content"] for line in data.train_file.read_text().splitlines()]
    assert held and trained and not held & set(trained)
    assert data.n_train + len(data.held_out) == len(traces)
    written = [json.loads(line)["trace_id"] for line in data.traces_file.read_text().splitlines()]
    assert sorted(written) == sorted(t.trace_id for t in traces)  # held out + the training episodes' own


def test_split_feeds_the_eval_exactly_the_held_out_queries_and_the_domains_of_the_trained(tmp_path):
    from services.evaluate.curves import per_domain_choice
    from services.evaluate.inputs import held_out as eval_held_out
    from services.evaluate.inputs import load_traces_file

    queries, _, _ = adi()
    traces = [adi_trace(q) for q in sorted(queries, key=int)]
    episodes = [episode(t.query, "good > cheap = flaky", ["good", "cheap", "flaky"], ep_id=f"e-{t.trace_id}")
                .model_copy(update={"trace_id": t.trace_id}) for t in traces]
    unjudged = traces[-1]  # a trace without an episode is neither trained on nor held out
    data = split(traces, [ep for ep in episodes if ep.trace_id != unjudged.trace_id], 0.3, tmp_path)
    train = [ep for ep in episodes if ep.trace_id not in {t.trace_id for t in data.held_out}
             and ep.trace_id != unjudged.trace_id]
    written = load_traces_file(data.traces_file)
    kept = eval_held_out(written, train).traces
    assert {t.trace_id for t in kept} == {t.trace_id for t in data.held_out}
    assert unjudged not in data.held_out and unjudged.trace_id not in {t.trace_id for t in written}
    assert per_domain_choice(train, written, "cheap")  # the trained traces' query ids give their domain


def test_synthetic_traffic_only_ever_trains(tmp_path):
    """A synthetic query (no qrels) is never held out, whatever its id hashes to; its episode trains."""
    from services.tools.traffic import is_synthetic

    synth = [trace(f"s{i}", query=f"synthetic query {i}", query_id=f"adi/synth-{i}-title") for i in range(60)]
    episodes = [episode(t.query, "a > b", ["a", "b"], ep_id=f"e-{t.trace_id}").model_copy(update={"trace_id": t.trace_id})
                for t in synth]
    assert sum(held_out(t.query_id, 0.3) for t in synth) > 0  # by hash alone, some would be held out
    data = split(synth, episodes, 0.3, tmp_path)
    assert data.held_out == [] and data.n_train == len(synth)
    assert all(is_synthetic(t.query_id) for t in synth) and not is_synthetic("adi/16") and not is_synthetic(None)


def test_render_routed_separates_slice_router_and_fallbacks():
    qid = sorted(adi()[0], key=int)[0]
    fan = adi_trace(qid)
    good, cheap = fan.candidates[0], fan.candidates[1]
    routed = trace("r1", [good], query=fan.query, query_id=fan.query_id, mode="routed")
    fallback = routed.model_copy(update={
        "trace_id": "r2", "router_version": None, "candidates": (cheap,),
        "route": Route(called=("cheap",), fallback="no_adapter", fallback_provider="cheap")})
    lines = render_routed([fan, routed, fallback]).splitlines()
    rows = {line.split("  ")[0].strip(): line.split() for line in lines[1:]}
    assert set(rows) == {"fan-out slice", "router router@1", "fallback (no_adapter)"}
    assert rows["fan-out slice"][-2] == "3.00"  # every provider was called
    assert float(rows["router router@1"][-1]) > float(rows["fallback (no_adapter)"][-1])  # good beats cheap


def test_demo_refuses_bad_arguments(capsys):
    assert main(["demo", "--queries", "3"]) == 2
    assert main(["demo", "--held-out", "0.99"]) == 2
    assert main(["demo", "--passes", "0"]) == 2
    assert main(["demo", "--synthetic", "-5"]) == 2
    assert "--passes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--select-pass", "best"])
    assert "--select-pass: invalid choice: 'best'" in capsys.readouterr().err


def test_select_pass_reaches_the_demo_options(monkeypatch):
    import services.tools.demo as demo

    seen = []

    async def fake_run(opts):
        seen.append(opts)
        return 0

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert main(["demo", "--select-pass", "last", "--passes", "2"]) == 0
    assert main(["demo"]) == 0
    assert [(o.select_pass, o.passes) for o in seen] == [("last", 2), ("route", 3)]


def _fake_passes(monkeypatch, tmp_path, finals: list[dict]) -> tuple[list, list]:
    """The trainer (one summary per pass, from ``finals``) and the publisher client, recorded."""
    import services.common.publisher_client as pc
    import services.trainer.launch as launch

    runs, published = [], []

    def fake_train(settings):
        runs.append(settings)
        (settings.output_dir / "adapter").mkdir(parents=True)
        (settings.output_dir / "adapter" / "which").write_text(str(len(runs)))
        return {"adapter_dir": str(settings.output_dir / "adapter"), "published": None, "final": finals[len(runs) - 1]}

    class FakeClient:
        def __init__(self, url):
            self.url = url

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def publish(self, model_id, adapter_dir, base_model, metrics):
            published.append((self.url, model_id, (Path(adapter_dir) / "which").read_text(), metrics))
            return {"version": 1}

    monkeypatch.setattr(launch, "train_in_process", fake_train)
    monkeypatch.setattr(pc, "PublisherClient", FakeClient)
    return runs, published


def _route(best: float, cost: float, n: int | None = None) -> dict:
    return {"test/route_best": best, "test/route_cost": cost, "train/loss": 0.1, **({"test/route_n": n} if n else {})}


def test_a_pass_worse_by_less_than_one_eval_episode_does_not_stop_the_chain(monkeypatch, tmp_path):
    from services.common.settings import KafkaSettings, RedisSettings
    from services.tools.demo_loop import LoopOptions, _train

    # 38 eval episodes: pass 2 is 0.002 below pass 1 (under 1/38), so pass 3 runs and, best, is published
    finals = [_route(0.90, 0.001, 38), _route(0.898, 0.001, 38), _route(0.95, 0.001, 38)]
    runs, published = _fake_passes(monkeypatch, tmp_path, finals)
    result = _train(KafkaSettings(bootstrap_servers="memory://"), RedisSettings(url="memory://"),
                    tmp_path / "episodes.jsonl", "http://127.0.0.1:9", tmp_path, LoopOptions(passes=3))
    assert len(runs) == 3 and result["pass"] == 3 and published[0][2] == "3"


def test_chained_passes_start_each_run_from_the_previous_adapter_and_the_best_by_routing_is_published(
        monkeypatch, tmp_path):
    from services.common.settings import KafkaSettings, RedisSettings
    from services.tools.demo_loop import LoopOptions, _train

    # λ = 150: utilities 0.55, 0.62, 0.60 — the third is below the second, so the chain stops there
    finals = [_route(0.85, 0.002), _route(0.92, 0.002), _route(0.90, 0.002), _route(0.99, 0.0)]
    runs, published = _fake_passes(monkeypatch, tmp_path, finals)
    result = _train(KafkaSettings(bootstrap_servers="memory://"), RedisSettings(url="memory://"),
                    tmp_path / "episodes.jsonl", "http://127.0.0.1:9", tmp_path, LoopOptions(passes=4))
    assert [r.init_adapter for r in runs] == [None, runs[0].output_dir / "adapter", runs[1].output_dir / "adapter"]
    assert all(r.publisher_url is None for r in runs)  # the demo publishes the chosen pass itself
    assert len({r.seed for r in runs}) == 3 and len({r.output_dir for r in runs}) == 3  # a new data order each pass
    assert result["pass"] == 2 and result["passes_run"] == 3 and result["published"] == {"version": 1}
    assert result["adapter_dir"] == str(tmp_path / "train" / "run" / "adapter")  # the published one, where the demo looks
    assert (tmp_path / "train" / "run" / "adapter" / "which").read_text() == "2"
    assert published == [("http://127.0.0.1:9", "router", "2", finals[1])]


def test_the_last_pass_is_published_when_asked_and_unmeasured_passes_never_stop_the_chain(monkeypatch, tmp_path):
    from services.common.settings import KafkaSettings, RedisSettings
    from services.tools.demo_loop import LoopOptions, _train, chosen_pass, one_query, pass_utility, stop_after

    finals = [_route(0.9, 0.0), _route(0.5, 0.0), _route(0.6, 0.0)]
    runs, published = _fake_passes(monkeypatch, tmp_path, finals)
    result = _train(KafkaSettings(bootstrap_servers="memory://"), RedisSettings(url="memory://"),
                    tmp_path / "episodes.jsonl", "http://127.0.0.1:9", tmp_path,
                    LoopOptions(passes=3, select_pass="last"))
    assert len(runs) == 3 and result["pass"] == 3 and published[0][2] == "3"
    assert pass_utility({"train/loss": 0.1}, 150.0) is None and pass_utility(_route(0.9, 0.001), 150.0) == 0.75
    assert not stop_after([0.9, None], 2) and not stop_after([0.9], 1)  # nothing to compare with
    assert not stop_after([0.9, 0.5], 3) and stop_after([0.9, 0.5], 2)  # never before min_passes
    assert not stop_after([0.747, 0.745], 2, 1 / 38) and stop_after([0.747, 0.70], 2, 1 / 38)  # within one episode
    assert one_query({"test/route_n": 38.0}) == 1 / 38 and one_query({}) == 0.0
    assert chosen_pass([None, None]) == 1 and chosen_pass([0.5, 0.7, 0.7]) == 2  # a tie goes to the later pass


async def test_the_demo_gate_is_computed_on_the_validation_half_and_published():
    from schemas.calibration import CalibrationRecord
    from services.common.settings import KafkaSettings
    from services.common.splits import dev_half
    from services.judge.backends.local import LocalJudge
    from services.tools.demo import _calibration_gate

    kafka = KafkaSettings(bootstrap_servers="memory://")
    traces = [adi_trace(q, trace_id=f"t-{q}") for q in sorted(adi()[0], key=int)]
    right = {t.trace_id: (("good", "flaky"), ("cheap",)) for t in traces}  # agrees with the qrels
    wrong = {t.trace_id: (("cheap",), ("good", "flaky")) for t in traces}  # the reverse
    # the judge is right on the validation half and wrong on the tuning half: only the first may count
    judged = {tid: right[tid] if dev_half(t.query_id or "") == "validation" else wrong[tid]
              for t in traces for tid in [t.trace_id]}
    record = await _calibration_gate(kafka, LocalJudge(), traces, judged, [])  # published on the in-memory bus
    n_val = sum(dev_half(t.query_id or "") == "validation" for t in traces)
    assert record.open and record.tau_b > 0.7 and 0 < record.n <= n_val < len(traces)
    assert isinstance(record, CalibrationRecord) and record.human_source == "qrels"
    from services.judge.calibrate import against_qrels

    assert against_qrels(traces, judged).overall.tau_informative < 0.5  # all traces would have counted the wrong half


@pytest.mark.parametrize(("market", "judge_env", "judge"), [
    ("nested", None, '{"type": "local"}'),  # the embedding judge is refused on nested: the lexical one
    ("nested", '{"type": "openai"}', '{"type": "openai"}'),  # an explicit judge is kept
    ("federated", None, None),
])
def test_demo_market_flag_sets_the_market_every_service_reads(monkeypatch, market, judge_env, judge):
    import os

    import services.tools.demo as demo

    seen = {}

    async def fake_run_demo(opts):
        seen.update(market=os.environ.get("FANROUTE_MARKET"), judge=os.environ.get("FANROUTE_JUDGE"))
        return 0

    # set first, so monkeypatch restores both variables to what they were after the flag changes them
    monkeypatch.setenv("FANROUTE_MARKET", "unset-by-the-test")
    monkeypatch.setenv("FANROUTE_JUDGE", judge_env or "unset-by-the-test")
    if judge_env is None:
        monkeypatch.delenv("FANROUTE_JUDGE")
    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert main(["demo", "--market", market]) == 0
    assert seen == {"market": market, "judge": judge}


async def test_the_demo_starts_its_own_stack_on_wiped_broker_storage(monkeypatch, tmp_path):
    """A previous run's adapter announcements must not reach this run's sampler (their versions repeat)."""
    import devstack
    import services.tools.demo as demo
    from services.tools.demo import DEMO_STACK, DemoOptions, run_demo

    calls = []
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("FANROUTE_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(devstack, "down", lambda state_dir, wipe=False: calls.append(("down", state_dir, wipe)))
    monkeypatch.setattr(devstack, "up", lambda state_dir, *a, **kw: calls.append(("up", state_dir)) or SimpleNamespace(
        bootstrap_servers="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0"))

    async def fake_demo_on(opts, kafka, redis_url):
        return 0

    monkeypatch.setattr(demo, "demo_on", fake_demo_on)
    assert await run_demo(DemoOptions(out_dir=tmp_path)) == 0
    assert calls[:2] == [("down", DEMO_STACK, True), ("up", DEMO_STACK)]


async def test_an_embedded_server_leaves_the_process_signal_handlers_alone():
    """uvicorn would turn SIGTERM into "stop this one server" and the demo would carry on without it."""
    import signal

    from fastapi import FastAPI

    from services.tools.serving import free_port, served

    def mine(signum, frame):
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        async with served(FastAPI(), free_port(), what="probe"):
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("keep_stack", [False, True])
async def test_the_demo_ends_with_the_console_command_over_its_topics(monkeypatch, tmp_path, capsys, keep_stack):
    """The exact `fanroute console` command (this run's broker, Redis, runs and a store of its own) and the URL."""
    import shlex

    import devstack
    import services.tools.demo as demo
    from services.console.settings import ConsoleSettings

    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("FANROUTE_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(devstack, "down", lambda state_dir, wipe=False: None)
    monkeypatch.setattr(devstack, "up", lambda state_dir, *a, **kw: SimpleNamespace(
        bootstrap_servers="127.0.0.1:39092", redis_url="redis://127.0.0.1:36379/0"))
    stale = demo.console_store(tmp_path)
    stale.write_text("a previous run's offsets")

    async def fake_demo_on(opts, kafka, redis_url):
        return 0

    monkeypatch.setattr(demo, "demo_on", fake_demo_on)
    assert await demo._run_demo(demo.DemoOptions(out_dir=tmp_path, keep_stack=keep_stack)) == 0
    assert not stale.exists()  # its offsets were of the wiped topics
    out = capsys.readouterr().out
    tail = out[out.index("the operator console"):].splitlines()
    *assignments, program, command = shlex.split(tail[1])
    assert (program, command) == ("fanroute", "console")
    env = dict(a.split("=", 1) for a in assignments)
    assert env == {"FANROUTE_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:39092",
                   "FANROUTE_REDIS__URL": "redis://127.0.0.1:36379/0", "FANROUTE_RUNS_DIR": str(tmp_path),
                   "FANROUTE_STORE_PATH": str(stale)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = ConsoleSettings()  # the console reads exactly these
    assert (settings.kafka.bootstrap_servers, settings.runs_dir, settings.store_path) == (
        "127.0.0.1:39092", tmp_path, stale)
    assert tail[2] == f"  then open {demo.CONSOLE_URL}" == f"  then open http://{settings.host}:{settings.port}"
    assert ("--keep-stack" in "\n".join(tail[3:])) is not keep_stack
