"""``fanroute eval`` end to end against a fake OpenAI-compatible router and the local judge, on ADI
traces with real qrels; and its bad-input errors."""

from __future__ import annotations

import json
import math

import pytest

from services.cli import main
from services.common.dataset import write_jsonl
from services.common.splits import dev_half
from tests.support.http_fake import router_server, scoring_router_app
from tests.support.serving import LoopbackServer
from tests.support.records import adi, adi_trace, candidate, episode, trace

PROVIDERS = ("good", "cheap", "flaky")


def _answer(model: str, query: str) -> str | None:
    return {"router@2": "good > flaky > cheap", "router@1": "I am not sure, sorry.", "router@5": None}[model]


@pytest.fixture(scope="module")
def router():
    with router_server(_answer, ["router@1", "router@2", "router@5"]) as server:
        yield server.url().rstrip("/")


@pytest.fixture
def inputs(tmp_path):
    qids = sorted(adi()[1], key=int)
    held, trained = qids[:6], qids[6:8]
    traces = [adi_trace(q, flaky_error=(i == 0)) for i, q in enumerate(held)]
    traces += [adi_trace(q) for q in trained]  # queries the student trained on: excluded
    traces.append(trace("routed-1", [candidate("good")], mode="routed"))  # not a fan-out trace
    queries = adi()[0]
    eps = [episode(queries[q], "cheap > good > flaky", PROVIDERS, ep_id=f"e{q}") for q in trained]
    write_jsonl(traces, tmp_path / "traces.jsonl")
    write_jsonl(eps, tmp_path / "train.jsonl")
    return tmp_path


def _eval_args(inputs, router, *extra: str) -> list[str]:
    return ["eval", "--traces", str(inputs / "traces.jsonl"), "--train-episodes", str(inputs / "train.jsonl"),
            "--router-url", router, "--out", str(inputs / "out"), "--no-progress", "--bootstrap", "200",
            "--router-mode", "generate", *extra]  # the fake router writes orderings


def test_eval_end_to_end(inputs, router, capsys):
    code = main(_eval_args(inputs, router, "--candidate", "router@2", "--deployed", "router@1"))
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((inputs / "out" / "eval.json").read_text())
    assert (inputs / "out" / "cost_quality.png").read_bytes()[:4] == b"\x89PNG"
    i = report["inputs"]
    assert (i["held_out"], i["traces_read"], i["human_queries"], i["judge_failed"]) == (6, 9, 6, 0)
    assert i["excluded"]["trained_query"] == 2 and i["excluded"]["not_fanout"] == 1
    assert i["best_single"]["provider"] == "cheap"  # chosen on the training episodes only
    assert i["judge"]["model"].startswith("local-lexical+minilm-v1:") and len(i["judge"]["rubric_hash"]) >= 8
    p = report["policies"]
    assert p["candidate"]["human"]["mean"] == pytest.approx(1.0)  # good cites every relevant document
    assert p["best_single"]["human"]["mean"] == 0.0
    assert p["deployed"]["fallbacks"] == {"unparseable": 6}  # garbage answers: counted, best single answered
    assert p["deployed"]["human"]["mean"] == 0.0 and p["candidate"]["fallbacks"] == {}
    assert p["candidate"]["oracle_gain_share"]["human"] == pytest.approx(1.0)
    assert p["fanout"]["calls_per_query"] == 3 and p["oracle"]["calls_per_query"] == 1
    assert p["candidate"]["latency_p50_ms"] >= 300  # router time + the good provider's 300 ms
    assert p["candidate"]["judge"]["mean"] > p["best_single"]["judge"]["mean"]
    comp = {(c["a"], c["b"], c["measure"]): c for c in report["comparisons"]}
    c = comp[("candidate", "best_single", "human")]
    assert (c["wins"], c["ties"], c["losses"], c["n"]) == (6, 0, 0, 6) and c["ci95"][0] > 0
    assert len(report["queries"]) == 6 and set(report["queries"][0]["outcomes"]) == {
        "candidate", "deployed", "best_single", "judge_oracle", "oracle", "fanout"}
    assert p["judge_oracle"]["calls_per_query"] == 1  # the judge's top pick, scored on the qrels
    assert p["judge_oracle"]["human"]["mean"] <= p["oracle"]["human"]["mean"]
    first = next(q for q in report["queries"] if q["trace_id"] == "adi-1")
    assert first["outcomes"]["candidate"]["called"] == ["good"]
    assert "candidate (router@2)" in out and "best_single (cheap)" in out and "fallbacks: unparseable 6" in out


SCORES = {"good": math.log(0.7), "flaky": math.log(0.2), "cheap": math.log(0.1)}


@pytest.fixture(scope="module")
def scoring_router():
    app = scoring_router_app(lambda model, query, name: SCORES[name], ["router@2"])
    with LoopbackServer(app, name="fake-vllm") as server:
        yield server.url().rstrip("/")


def test_a_scoring_router_is_drawn_over_lambda_on_the_cost_quality_plane(inputs, scoring_router, capsys):
    args = _eval_args(inputs, scoring_router, "--candidate", "router@2", "--deployed", "none")
    assert main([a for a in args if a not in ("--router-mode", "generate")]) == 0  # scoring is the default
    out = capsys.readouterr().out
    report = json.loads((inputs / "out" / "eval.json").read_text())
    assert report["policies"]["candidate"]["human"]["mean"] == pytest.approx(1.0)  # λ = 0: good, P 0.7
    assert report["policies"]["candidate"]["router_p99_ms"] > 0
    human = report["frontier"]["human"]
    assert (human["weak"], human["strong"]) == ("cheap", "good")
    first, last = human["router"][0], human["router"][-1]
    assert first["lam"] == 0 and (first["cost"], first["quality"]) == pytest.approx((0.004, 1.0))
    assert last["cost"] == pytest.approx(0.001)  # a large λ: always the cheapest provider
    assert {b["name"] for b in human["baselines"]} >= {"best_single", "oracle", "judge_oracle", "fanout"}
    assert 0 <= human["aiq_router"] <= 1 and human["apgr"] is not None and human["cpt80"] is not None
    assert set(report["frontier"]) == {"human", "judge"}
    assert (inputs / "out" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "candidate over λ, human: cost-quality" in out and "AIQ router" in out and "APGR" in out


def test_a_rates_file_gives_every_adapter_asked_its_top_tier_table(inputs, scoring_router, capsys):
    """Without a publisher an adapter has no top-tier table and decides by the first choice ('good', P 0.7);
    a table that puts 'cheap' in every label's top tier sends every query there. A bad file is named."""
    from services.router.rates import to_json

    args = [a for a in _eval_args(inputs, scoring_router, "--candidate", "router@2", "--deployed", "none")
            if a not in ("--router-mode", "generate")]
    assert main(args) == 0
    untabled = json.loads((inputs / "out" / "eval.json").read_text())
    assert {q["outcomes"]["candidate"]["called"][0] for q in untabled["queries"]} == {"good"}
    n = untabled["inputs"]["held_out"]
    assert untabled["inputs"]["untabled"] == {"router@2": n}  # said, not silent: in the report and on stdout
    assert untabled["inputs"]["rates_from"] == "none"  # so `fanroute promote --eval` refuses it
    assert f"routers decide by top-tier, λ = 0; router@2: {n} answers had no top-tier table" in capsys.readouterr().out
    table = inputs / "top_tier_rates.json"
    table.write_text(json.dumps(to_json({lab: {"cheap": 1.0, "good": 0.0, "flaky": 0.0} for lab in PROVIDERS}, 9)))
    assert main([*args, "--rates-file", str(table)]) == 0
    report = json.loads((inputs / "out" / "eval.json").read_text())
    assert {q["outcomes"]["candidate"]["called"][0] for q in report["queries"]} == {"cheap"}
    assert report["inputs"]["untabled"] == {} and report["inputs"]["rates_from"] == "file"
    capsys.readouterr()
    table.write_text('{"format": "something else"}')
    _fails(capsys, [*args, "--rates-file", str(table)],
           "--rates-file", "top_tier_rates.json", "fanroute-top-tier-rates")
    _fails(capsys, [*args, "--rates-file", str(inputs / "missing.json")], "--rates-file", "missing.json")


def test_router_server_errors_are_counted_fallbacks(inputs, router, capsys):
    assert main(_eval_args(inputs, router, "--candidate", "router@5", "--deployed", "none")) == 0
    assert "first router_error: router router@5: HTTP 500" in capsys.readouterr().out
    cand = json.loads((inputs / "out" / "eval.json").read_text())["policies"]["candidate"]
    assert cand["fallbacks"] == {"router_error": 6} and "HTTP 500" in cand["fallback_examples"]["router_error"]
    assert "deployed" not in json.loads((inputs / "out" / "eval.json").read_text())["policies"]


def _fails(capsys, argv, *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err


def test_unknown_adapter_is_the_routers_404(inputs, router, capsys):
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@9", "--deployed", "none"),
           "does not serve 'router@9' (404)", "does not exist")


def test_router_unreachable(inputs, capsys):
    _fails(capsys, _eval_args(inputs, "http://127.0.0.1:9", "--candidate", "router@2", "--deployed", "none"),
           "unreachable at http://127.0.0.1:9")


def test_malformed_episodes_and_traces_name_file_and_line(inputs, router, capsys):
    lines = (inputs / "train.jsonl").read_bytes()
    (inputs / "train.jsonl").write_bytes(lines + b"{not json\n")
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none"),
           "train.jsonl:3: not an episode")
    (inputs / "train.jsonl").write_bytes(lines)
    (inputs / "traces.jsonl").write_bytes(b"\n" + b'{"trace_id": "x"}\n')
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none"),
           "traces.jsonl:2: not a trace")


def test_other_bad_input(inputs, router, capsys):
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2"), "--deployed auto", "--publisher-url")
    _fails(capsys, _eval_args(inputs, router, "--candidate", "bad name@x", "--deployed", "none"),
           "not a served adapter name")
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none",
                              "--since", "2026-01-01T00:00:00Z"), "--since/--until")
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none",
                              "--max-attempts", "0"), "max_attempts")
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: exit 2 naming the flag and the choices
        main(_eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none", "--decision", "best-guess"))
    assert exit_.value.code == 2 and "--decision" in capsys.readouterr().err
    write_jsonl([trace("r", [candidate("good")], mode="routed")], inputs / "traces.jsonl")
    _fails(capsys, _eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none"),
           "no held-out fan-out trace", "not_fanout")


def _linear_inputs(tmp_path, odd: str, even: str) -> None:
    """Six held-out ADI traces and twenty trained ones whose episodes alternate the orderings ``odd``/``even``:
    enough for eval to fit its linear router."""
    qids = sorted(adi()[1], key=int)
    held, trained = qids[:6], qids[6:26]
    queries = adi()[0]
    write_jsonl([adi_trace(q) for q in held] + [adi_trace(q) for q in trained], tmp_path / "traces.jsonl")
    write_jsonl([episode(queries[q], odd if i % 2 else even, PROVIDERS, ep_id=f"e{q}") for i, q in enumerate(trained)],
                tmp_path / "train.jsonl")


def test_the_linear_router_of_the_same_episodes_is_a_row_and_a_comparison(tmp_path, router, capsys):
    """With enough training episodes, eval fits the TF-IDF + logistic-regression router on them and
    replays it like any router: a row with its decision time, compared with the candidate."""
    _linear_inputs(tmp_path, "good > cheap > flaky", "cheap > good > flaky")
    assert main(_eval_args(tmp_path, router, "--candidate", "router@2", "--deployed", "none")) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    lin = report["policies"]["linear"]
    assert lin["adapter"] == "linear:tfidf-logreg" and lin["queries"] == 6 and lin["fallbacks"] == {}
    assert lin["router_p50_ms"] > 0 and lin["human"]["n"] == 6
    assert report["inputs"]["linear"]["train_episodes"] == 20
    assert report["inputs"]["linear"]["labels"] == {"cheap": 10, "good": 10}
    assert {(c["a"], c["b"]) for c in report["comparisons"]} >= {("candidate", "linear"), ("linear", "best_single")}
    assert all(q["outcomes"]["linear"]["called"][0] in ("good", "cheap") for q in report["queries"])
    assert "linear (linear:tfidf-logreg)" in out


def test_the_label_ceiling_per_collection(inputs, router, capsys):
    """Every held-out ADI query lands in one collection row: the judge-oracle beside the hindsight best."""
    assert main(_eval_args(inputs, router, "--candidate", "router@2", "--deployed", "none")) == 0
    out = capsys.readouterr().out
    report = json.loads((inputs / "out" / "eval.json").read_text())
    [row] = report["collections"]
    assert row["collection"] == "adi" and row["queries"] == 6 and row["hindsight_best"] == "good"
    assert row["hindsight_best_ndcg"] == pytest.approx(1.0) and row["candidate_ndcg"] == pytest.approx(1.0)
    assert sum(row["judge_first_counts"].values()) == 6
    assert row["judge_first_not_best"] == 6 - row["judge_first_counts"].get("good", 0)
    assert "the label ceiling per collection" in out and "adi" in out
    # and the same queries by the dev half they lie in (what was tuned on them), each half its own figures
    halves = {r["half"]: r for r in report["dev_halves"]}
    held = [q["query_id"] for q in report["queries"]]
    assert {h: r["queries"] for h, r in halves.items()} == {
        h: n for h in ("tune", "validation") if (n := sum(dev_half(q) == h for q in held))}
    assert all(r["human"]["candidate"] == pytest.approx(1.0) for r in halves.values())
    assert "by half of the dev queries" in out


@pytest.mark.parametrize("decision", ["top-tier", "first-choice"])
def test_the_decision_is_the_gateways_top_tier_or_first_choice(tmp_path, router, capsys, decision):
    """Labels 'cheap' and 'flaky' each tie with 'good' in the judge's top tier: by the top-tier table every
    query goes to 'good' (in the top tier whatever the label), by the first choice never."""
    _linear_inputs(tmp_path, "cheap = good > flaky", "flaky = good > cheap")
    assert main(_eval_args(tmp_path, router, "--candidate", "router@2", "--deployed", "none",
                           "--decision", decision)) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["inputs"]["decision"] == decision
    firsts = {q["outcomes"]["linear"]["called"][0] for q in report["queries"]}
    assert firsts == {"good"} if decision == "top-tier" else "good" not in firsts
