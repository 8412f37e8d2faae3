"""The promotion rule (every refusal reason) and ``fanroute promote`` against a fake publisher client."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from services.cli import main
from services.common.publisher_client import PublisherClientError
from services.evaluate.baseline import BestSingle, ProviderRecord
from services.evaluate.metrics import MeasureStats, PolicyMetrics
from services.evaluate.promote import EXIT_REFUSED, decide
from services.evaluate.report import EvalInputs, EvalReport, JudgeRecord, write_json


def _metrics(policy: str, human: float | None, judge: float | None, adapter: str | None = None, *,
             cost: float = 0.001, router_p99_ms: float | None = None,
             fallbacks: dict[str, int] | None = None) -> PolicyMetrics:
    return PolicyMetrics(policy=policy, adapter=adapter, queries=10,
                         human=MeasureStats(mean=human, n=0 if human is None else 10),
                         judge=MeasureStats(mean=judge, n=10), calls_per_query=1, cost_per_query_usd=cost,
                         latency_p50_ms=100, latency_p99_ms=200,
                         router_p50_ms=None if router_p99_ms is None else router_p99_ms / 2, router_p99_ms=router_p99_ms,
                         fallbacks=fallbacks or {})


def make_report(cand=(0.6, 2.0), best=(0.5, 1.5), deployed=(0.55, 1.8), *, candidate="router@3",
                deployed_name: str | None = "router@2", cand_cost: float = 0.001,
                cand_router_p99_ms: float | None = 80.0, cand_fallbacks: dict[str, int] | None = None) -> EvalReport:
    policies = {"candidate": _metrics("candidate", *cand, adapter=candidate, cost=cand_cost,
                                      router_p99_ms=cand_router_p99_ms, fallbacks=cand_fallbacks),
                "best_single": _metrics("best_single", *best),
                "oracle": _metrics("oracle", 0.7, 2.5), "fanout": _metrics("fanout", 0.55, 1.9)}
    if deployed_name is not None:
        policies["deployed"] = _metrics("deployed", *deployed, adapter=deployed_name)
    inputs = EvalInputs(
        traces_source="file t.jsonl", traces_read=12, excluded={"trained_query": 2}, held_out=10, human_queries=10,
        judge_failed=0, train_episodes_file="train.jsonl", train_episodes=40, candidate=candidate,
        deployed=deployed_name, deployed_source="auto" if deployed_name else "none", router_url="http://r",
        router_timeout_s=2, router_max_tokens=48, max_attempts=2,
        judge=JudgeRecord(kind="local", model="local-lexical-v1", rubric_version="v1", rubric_hash="abcdef0123"),
        best_single=BestSingle(provider="bm25-all", episodes_used=40, episodes_unreadable=0,
                               table=(ProviderRecord(provider="bm25-all", episodes=40, top_share=0.6,
                                                     mean_position=0.8),)),
        seed=0)
    return EvalReport(created_at=datetime.now(UTC), inputs=inputs, policies=policies, comparisons=[])


def test_promotes_when_it_beats_both_baselines_on_both_measures():
    d = decide(make_report())
    assert d.decision == "promote" and all(c.passed for c in d.checks)
    assert [c.rule for c in d.checks] == ["quality"] * 4 + ["reliability", "cost"]
    assert d.decided_by == ["cost", "quality", "reliability"]
    assert d.fallback_provider == "bm25-all"
    assert any("human: candidate 0.6000 beats best_single (bm25-all) 0.5000" in r for r in d.reasons)


def test_no_deployed_router_means_only_the_best_single_baseline():
    d = decide(make_report(deployed_name=None))
    assert d.decision == "promote" and {c.baseline for c in d.checks if c.rule == "quality"} == {"best_single"}
    assert "cost" not in {c.rule for c in d.checks}


@pytest.mark.parametrize("kwargs, reason", [
    ({"cand": (0.6, 1.4)}, "judge: candidate 1.4000 does not beat best_single (bm25-all) 1.5000"),
    ({"cand": (0.45, 2.0)}, "human: candidate 0.4500 does not beat best_single (bm25-all) 0.5000"),
    ({"deployed": (0.65, 1.8)}, "human: candidate 0.6000 does not beat deployed (router@2) 0.6500"),
    ({"deployed": (0.55, 2.1)}, "judge: candidate 2.0000 does not beat deployed (router@2) 2.1000"),
    ({"cand": (0.5, 2.0)}, "does not beat best_single (bm25-all) 0.5000"),  # equal is not better
    ({"cand": (None, 2.0), "best": (None, 1.5), "deployed": (None, 1.8)}, "no human measure"),
    ({"deployed_name": "router@3"}, "router@3 is already the deployed router"),
])
def test_every_refusal_reason(kwargs, reason):
    d = decide(make_report(**kwargs))
    assert d.decision == "refuse"
    assert any(reason in r for r in d.reasons), d.reasons


@pytest.mark.parametrize(("rates_from", "untabled", "promoted"), [
    ("none", {"router@3": 10}, False),  # no table anywhere: measured by the first choice, not as the gateway decides
    ("publisher", {"router@3": 10}, True),  # the version published none: the gateway decides that way too
    ("file", {}, True),
    ("none", {"router@2": 10}, True),  # only the deployed router lacked one
])
def test_a_top_tier_candidate_evaluated_without_its_table_is_refused(rates_from, untabled, promoted):
    report = make_report()
    report = report.model_copy(update={"inputs": report.inputs.model_copy(
        update={"decision": "top-tier", "rates_from": rates_from, "untabled": untabled})})
    d = decide(report)
    assert (d.decision == "promote") is promoted, d.reasons
    if not promoted:
        assert d.decided_by[0] == "decision_mismatch"
        assert "router@3 was evaluated without a top-tier table" in d.reasons[0] and "--publisher-url" in d.reasons[0]


def test_min_gain():
    assert decide(make_report(), min_gain=0.02).decision == "promote"
    d = decide(make_report(), min_gain=0.06)
    assert d.decision == "refuse" and any("by more than 0.06" in r for r in d.reasons)


def test_the_router_must_decide_within_the_latency_limit():
    assert decide(make_report(), max_router_p99_ms=100).decision == "promote"
    d = decide(make_report(cand_router_p99_ms=850.0), max_router_p99_ms=100)
    assert d.decision == "refuse" and d.decided_by == ["latency"]
    assert d.reasons == ["latency: candidate router p99 850.0 ms over the limit 100 ms (n=10)"]
    assert decide(make_report(cand_router_p99_ms=None), max_router_p99_ms=100).decided_by == ["latency"]  # unmeasured


def test_a_router_that_mostly_falls_back_is_refused_whatever_its_measures():
    assert decide(make_report(cand_fallbacks={"router_timeout": 0})).decision == "promote"
    d = decide(make_report(cand_fallbacks={"router_error": 10}))  # every answer was the fallback provider's
    assert d.decision == "refuse" and d.decided_by == ["reliability"]
    assert d.reasons == ["reliability: 100.0% of the candidate's answers were fallbacks, over the limit 5.0% (n=10)"]
    assert decide(make_report(cand_fallbacks={"router_error": 1}), max_fallback_share=0.1).decision == "promote"


def test_a_dearer_router_must_pay_for_itself_in_quality():
    # deployed costs 0.001; the candidate 0.002 and beats it by 0.05 human / 0.2 judge
    assert decide(make_report(cand_cost=0.002), cost_min_gain=0.04).decision == "promote"  # both gains >= 0.04
    d = decide(make_report(cand_cost=0.002), cost_min_gain=0.06)  # the human gain (0.05) is not enough
    assert d.decision == "refuse" and d.decided_by == ["cost"]
    assert "cost: candidate 0.00200 USD/query higher than deployed (router@2) 0.00100" in d.reasons[0]
    assert decide(make_report(cand_cost=0.002, deployed_name=None)).decision == "promote"  # nothing deployed


def test_the_decision_names_every_rule_that_refused():
    d = decide(make_report(cand=(0.45, 2.0), cand_cost=0.01, cand_router_p99_ms=900.0), max_router_p99_ms=100)
    assert d.decided_by == ["cost", "latency", "quality"] and len(d.reasons) == 4  # human fails twice


class FakePublisher:
    """Stands in for PublisherClient: a promoted record, and what promote() was called with."""

    promoted_record: dict | None = {"version": 2, "fallback_provider": "bm25-all"}
    promote_error: PublisherClientError | None = None
    unreachable = False
    calls: list

    def __init__(self, base_url: str, timeout_s: float = 60.0) -> None:
        self.base_url = base_url

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def promoted(self, model_id: str):
        if self.unreachable:
            raise PublisherClientError(f"GET {self.base_url}/v1/adapters/{model_id}/promoted: ConnectError")
        return self.promoted_record

    def promote(self, model_id, version, *, fallback_provider=None, evidence=None):
        if self.promote_error is not None:
            raise self.promote_error
        self.calls.append((model_id, version, fallback_provider, evidence))
        return {"model_id": model_id, "version": version, "promoted": True}


@pytest.fixture
def publisher(monkeypatch):
    import services.common.publisher_client as client_mod

    class P(FakePublisher):  # a fresh class per test: its attributes are that test's script
        calls: list = []

    monkeypatch.setattr(client_mod, "PublisherClient", P)
    return P


def _promote(tmp_path, report: EvalReport, *extra: str) -> int:
    path = write_json(report, tmp_path / "ev")
    return main(["promote", "--candidate", report.inputs.candidate, "--publisher-url", "http://pub",
                 "--eval", str(path), *extra])


def test_cli_promotes_with_evidence_and_writes_the_decision(tmp_path, publisher, capsys):
    assert _promote(tmp_path, make_report()) == 0
    out = capsys.readouterr().out
    assert "PROMOTE router@3" in out
    (model_id, version, fallback, evidence), = publisher.calls
    assert (model_id, version, fallback) == ("router", 3, "bm25-all")
    assert evidence["decision"]["decision"] == "promote" and "queries" not in evidence["eval"]
    assert evidence["eval"]["policies"]["candidate"]["human"]["mean"] == 0.6
    decision = json.loads((tmp_path / "ev" / "decision.json").read_text())
    assert decision["decision"] == "promote" and decision["promoted"] is True


def test_cli_passes_the_tie_share_to_the_rule(tmp_path, publisher, capsys):
    publisher.promoted_record = None  # nothing deployed, as the report says
    tied = make_report(cand=(0.6, 1.5), deployed_name=None)  # judge tie with best single, at the same cost
    cheap = tied.model_copy(update={"policies": {**tied.policies, "best_single": _metrics("best_single", 0.5, 1.5,
                                                                                          cost=0.003)}})
    assert _promote(tmp_path, cheap, "--tie-max-cost-share", "0.2") == EXIT_REFUSED  # a third is over 0.2
    assert _promote(tmp_path, cheap) == 0  # the default half
    assert "ties best_single (bm25-all) 1.5000 at 33% of its cost" in capsys.readouterr().out
    assert json.loads((tmp_path / "ev" / "decision.json").read_text())["tie_max_cost_share"] == 0.5


def test_cli_refuses_with_reasons_and_a_distinct_exit(tmp_path, publisher, capsys):
    assert _promote(tmp_path, make_report(cand=(0.6, 1.0))) == EXIT_REFUSED == 3
    out = capsys.readouterr().out
    assert "REFUSED router@3" in out and "judge: candidate 1.0000 does not beat" in out
    assert publisher.calls == []
    decision = json.loads((tmp_path / "ev" / "decision.json").read_text())
    assert decision["decision"] == "refuse" and decision["promoted"] is False and decision["reasons"]


def test_cli_bad_input(tmp_path, publisher, capsys):
    path = write_json(make_report(), tmp_path / "ev")
    base = ["promote", "--publisher-url", "http://pub", "--eval", str(path)]
    assert main([*base, "--candidate", "router@4"]) == 2
    assert "evaluated router@3, not --candidate router@4" in capsys.readouterr().err
    assert main([*base, "--candidate", "router"]) == 2
    assert "must name a version" in capsys.readouterr().err
    publisher.promoted_record = {"version": 1}  # someone promoted another version since the eval
    assert main([*base, "--candidate", "router@3"]) == 2
    assert "deployed router@2, but the publisher's promoted router is now router@1" in capsys.readouterr().err
    publisher.unreachable = True
    assert main([*base, "--candidate", "router@3"]) == 2
    assert "ConnectError" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{}")
    assert main(["promote", "--candidate", "router@3", "--publisher-url", "http://pub",
                 "--eval", str(tmp_path / "junk.json")]) == 2
    assert "not an eval.json written by fanroute eval" in capsys.readouterr().err
    assert main(["promote", "--candidate", "router@3", "--publisher-url", "http://pub"]) == 2
    assert "--train-episodes is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--candidate", "router@3", "--min-gain", "-1"])
    with pytest.raises(SystemExit):
        main([*base, "--candidate", "router@3", "--max-fallback-share", "1.5"])
    assert "must be within 0..1, got 1.5" in capsys.readouterr().err
    for junk in ("2", "half"):  # the tie clause's cost share: a share, or a clear refusal naming the flag
        with pytest.raises(SystemExit):
            main([*base, "--candidate", "router@3", "--tie-max-cost-share", junk])
        assert "--tie-max-cost-share" in capsys.readouterr().err
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["inputs"]["candidate"] == "router@3"  # untouched


@pytest.mark.parametrize("status, code", [(503, 1), (404, 2)])
def test_cli_publisher_failure_while_promoting(tmp_path, publisher, capsys, status, code):
    publisher.promote_error = PublisherClientError("HTTP error", status=status)
    assert _promote(tmp_path, make_report()) == code
    decision = json.loads((tmp_path / "ev" / "decision.json").read_text())
    assert decision["decision"] == "promote" and decision["promoted"] is False and decision["publisher_error"]


def test_an_lm_candidate_must_beat_the_linear_router_of_the_same_episodes():
    report = make_report(cand=(0.6, 2.0), deployed_name=None)
    linear = _metrics("linear", 0.62, 1.9, adapter="linear:tfidf-logreg")
    report = report.model_copy(update={"policies": {**report.policies, "linear": linear}})
    d = decide(report)
    assert d.decision == "refuse" and d.decided_by == ["quality"]
    assert any("human: candidate 0.6000 does not beat linear (linear:tfidf-logreg) 0.6200" in r for r in d.reasons)
    better = report.model_copy(update={"policies": {**report.policies, "linear": _metrics("linear", 0.55, 1.8,
                                                                                         adapter="linear:tfidf-logreg")}})
    assert decide(better).decision == "promote"


def test_a_tie_passes_only_at_a_fraction_of_the_baselines_cost():
    # the judge ties the best single provider exactly (coarse grades); the human measure is a real gain
    tied = make_report(cand=(0.6, 1.5), deployed_name=None)
    cheap = tied.model_copy(update={"policies": {**tied.policies, "best_single": _metrics("best_single", 0.5, 1.5,
                                                                                          cost=0.003)}})
    d = decide(cheap)  # the candidate costs 0.001: a third of the best single provider's
    assert d.decision == "promote"
    [judge] = [c for c in d.checks if c.measure == "judge"]
    assert judge.tie and judge.passed and judge.cost_share == pytest.approx(1 / 3)
    assert "judge: candidate 1.5000 ties best_single (bm25-all) 1.5000 at 33% of its cost (n=10)" in d.reasons
    # the same tie at the same cost is no gain; nor is a tie when ties are switched off
    d = decide(tied)
    assert d.decision == "refuse" and any("does not beat best_single (bm25-all) 1.5000 (n=10; costs 100% of it)" in r
                                          for r in d.reasons), d.reasons
    assert decide(cheap, tie_max_cost_share=0.0).decision == "refuse"
    assert decide(cheap, tie_max_cost_share=0.3).decision == "refuse"
    # a tie never excuses a loss, however cheap
    worse = cheap.model_copy(update={"policies": {**cheap.policies, "candidate": _metrics(
        "candidate", 0.6, 1.49, adapter="router@3", cost=0.0001, router_p99_ms=80.0)}})
    assert decide(worse).decision == "refuse"
    # a tie on the human measure is held to the same rule
    human_tie = cheap.model_copy(update={"policies": {**cheap.policies, "candidate": _metrics(
        "candidate", 0.5, 2.0, adapter="router@3", router_p99_ms=80.0)}})
    assert decide(human_tie).decision == "promote"
    assert decide(human_tie.model_copy(update={"policies": {**human_tie.policies, "best_single": _metrics(
        "best_single", 0.5, 1.5, cost=0.0015)}})).decision == "refuse"  # costs 67 % of it


def test_a_candidate_replaces_a_deployed_router_that_fell_below_the_best_single_provider():
    # a provider the deployed router relies on degraded: it is now below the best single provider on both
    # measures; the candidate beats it on both but not the best single provider -> promoted as a replacement
    d = decide(make_report(cand=(0.45, 1.9), best=(0.5, 2.0), deployed=(0.2, 1.3)))
    assert d.decision == "promote" and "replacement" in d.decided_by
    waived = [c for c in d.checks if c.waived]
    assert [(c.measure, c.baseline) for c in waived] == [("human", "best_single"), ("judge", "best_single")]
    assert any("waived: the deployed router fell below it" in r for r in d.reasons)
    # the deployed router still above the best single provider on one measure: no waiver, refused
    d = decide(make_report(cand=(0.45, 1.9), best=(0.5, 2.0), deployed=(0.2, 2.1)))
    assert d.decision == "refuse" and not any(c.waived for c in d.checks)
    # the candidate does not beat the deployed router on both measures: no waiver
    d = decide(make_report(cand=(0.45, 1.2), best=(0.5, 2.0), deployed=(0.2, 1.3)))
    assert d.decision == "refuse" and not any(c.waived for c in d.checks)
    # nothing deployed: the best single provider must be beaten as always
    d = decide(make_report(cand=(0.45, 1.9), best=(0.5, 2.0), deployed_name=None))
    assert d.decision == "refuse"


def test_no_replacement_while_the_deployed_routers_fall_is_within_the_noise():
    from services.evaluate.metrics import Paired

    report = make_report(cand=(0.45, 1.9), best=(0.5, 2.0), deployed=(0.2, 1.3))
    noisy = [Paired(a="deployed", b="best_single", measure=m, n=10, mean_diff=-0.1, wins=2, ties=3, losses=5,
                    ci95=(-0.3, 0.05)) for m in ("human", "judge")]
    assert decide(report.model_copy(update={"comparisons": noisy})).decision == "refuse"
    clear = [p.model_copy(update={"ci95": (-0.3, -0.05)}) for p in noisy]
    assert decide(report.model_copy(update={"comparisons": clear})).decision == "promote"


def test_a_quality_reason_says_when_the_margin_is_within_what_the_queries_can_detect():
    from services.evaluate.metrics import Paired

    report = make_report(cand=(0.6, 2.129), best=(0.5, 2.134), deployed_name=None)
    power = [Paired(a="candidate", b="best_single", measure=m, n=10, mean_diff=d, wins=1, ties=8, losses=1,
                    ci95=(-0.1, 0.1), mde80=mde) for m, d, mde in (("human", 0.1, 0.05), ("judge", -0.005, 0.112))]
    d = decide(report.model_copy(update={"comparisons": power}))
    assert d.decision == "refuse"  # reported beside the rule, never part of it
    judge, human = (next(c for c in d.checks if c.measure == m and c.rule == "quality") for m in ("judge", "human"))
    assert (judge.detectable, human.detectable) == (0.112, 0.05)
    assert "within the noise: 10 queries detect only differences from 0.112" in judge.line(0.0)
    assert "noise" not in human.line(0.0)  # 0.1 apart is more than the 0.05 it can see
    assert "noise" not in decide(report).checks[1].line(0.0)  # no comparisons: nothing said
