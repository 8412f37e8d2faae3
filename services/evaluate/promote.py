"""The promotion rule: a candidate router is promoted only when it beats the deployed router, the
best single provider and the linear router distilled from the same episodes on BOTH measures (the judge's grades and the humans' nDCG@10) on held-out data,
decides fast enough, and does not cost more than the deployed router without paying for it.

Four rules, each a :class:`Check` naming its rule:
- ``quality``: for every (measure, baseline) pair the candidate dominates the baseline on the
  cost–quality plane: its mean is above the baseline's by more than ``min_gain``, or — a tie — no lower
  while it costs at most ``tie_max_cost_share`` of the baseline per query (the same answers for half the
  price pay; the judge's coarse grades tie often: 146 of 186 held-out queries in a demo). The baselines are
  the best single provider, the deployed router and (when the report has it) the linear router trained on
  the same episodes — an LM router that a linear classifier of its own labels beats does not pay for
  itself; a measure with no data (no held-out query has qrels, or the judge graded none) refuses;
- ``latency``: the candidate's own decision time (the router call, not the providers) has p99 within
  ``max_router_p99_ms`` (when set);
- ``reliability``: at most ``max_fallback_share`` of the held-out queries were answered by a fallback
  (router error, timeout, unparseable answer): a candidate that rarely decides is the best single
  provider under another name, and its measures say nothing about it;
- ``cost``: with a deployed router, the candidate's cost per query is no higher than the deployed
  router's, unless it beats the deployed router by at least ``cost_min_gain`` on both measures.
A candidate that is already the deployed version is refused.

**Replacement.** When the deployed router has itself fallen below the best single provider on both
measures (the paired 95 % interval entirely below 0 where the report has one; a provider it relies on
degraded: ``fanroute loop demo``), the comparison with the best single
provider is waived for a candidate that beats the deployed router on both measures and passes every other
check: there is no way back to the best single provider but a promotion, so keeping the deployed router
is worse for every request. The waived checks say so (``waived``) and the decision names ``replacement``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.evaluate.metrics import MEASURES
from services.evaluate.policies import BEST_SINGLE, CANDIDATE, DEPLOYED, LINEAR
from services.evaluate.report import EvalReport

#: Exit status of ``fanroute promote`` when the rule refuses (0 = promoted, 2 = bad input, 1 = publisher failed).
EXIT_REFUSED = 3

#: A tie on a measure passes when the candidate costs at most this share of the baseline per query.
TIE_MAX_COST_SHARE = 0.5
#: Means this close are equal (the per-query grades are coarse; their means tie exactly).
TIE_EPS = 1e-9


class Check(BaseModel):
    """One (measure, baseline) comparison of the rule."""

    model_config = ConfigDict(frozen=True)
    rule: Literal["quality", "latency", "reliability", "cost"] = "quality"
    measure: str
    baseline: str = Field(description="best_single, deployed, linear, or limit (latency)")
    baseline_name: str | None = Field(description="The best single provider's or the deployed adapter's name")
    candidate_mean: float | None
    baseline_mean: float | None
    n: int
    passed: bool
    cost_share: float | None = Field(default=None, description="quality: the candidate's cost per query over the "
                                     "baseline's (a tie passes at or below the rule's share)")
    tie: bool = Field(default=False, description="quality: passed as a tie at a fraction of the baseline's cost")
    waived: bool = Field(default=False, description="quality vs best_single: not beaten, waived for a replacement "
                                                    "of a deployed router that fell below the best single provider")
    detectable: float | None = Field(default=None, description="quality: the smallest difference the held-out "
                                     "queries detect 80 % of the time (the paired comparison's mde80): a margin "
                                     "below it is within the noise of this evaluation")

    def line(self, min_gain: float) -> str:
        who = f"{self.baseline} ({self.baseline_name})"
        if self.rule == "latency":
            verb = "within" if self.passed else "over"
            return (f"latency: candidate router p99 {self.candidate_mean:.1f} ms {verb} the limit "
                    f"{self.baseline_mean:.0f} ms (n={self.n})")
        if self.rule == "reliability":
            verb = "within" if self.passed else "over"
            return (f"reliability: {self.candidate_mean:.1%} of the candidate's answers were fallbacks, {verb} "
                    f"the limit {self.baseline_mean:.1%} (n={self.n})")
        if self.rule == "cost":
            verb = "no higher than" if self.passed else "higher than"
            return (f"cost: candidate {self.candidate_mean:.5f} USD/query {verb} {who} {self.baseline_mean:.5f}"
                    f"{'' if self.passed or self.baseline_mean is None else ' without beating it by the cost gain'}")
        if self.candidate_mean is None or self.baseline_mean is None:
            return f"{self.measure}: no {self.measure} measure on the held-out queries (n={self.n}); cannot compare"
        if self.waived:
            return (f"{self.measure}: candidate {self.candidate_mean:.4f} does not beat {who} {self.baseline_mean:.4f}; "
                    f"waived: the deployed router fell below it on every measure and the candidate beats the "
                    f"deployed router (a replacement) (n={self.n})")
        if self.tie:
            return (f"{self.measure}: candidate {self.candidate_mean:.4f} ties {who} {self.baseline_mean:.4f} "
                    f"at {self.cost_share:.0%} of its cost (n={self.n})")
        verb = "beats" if self.passed else "does not beat"
        margin = f" by more than {min_gain:g}" if min_gain else ""
        share = "" if self.passed or self.cost_share is None else f"; costs {self.cost_share:.0%} of it"
        noise = ""
        if self.detectable is not None and abs(self.candidate_mean - self.baseline_mean) < self.detectable:
            noise = f"; within the noise: {self.n} queries detect only differences from {self.detectable:.3f}"
        return (f"{self.measure}: candidate {self.candidate_mean:.4f} {verb} {who} {self.baseline_mean:.4f}"
                f"{margin} (n={self.n}{share}{noise})")


class Decision(BaseModel):
    """``decision.json``: what was decided, why, and the numbers compared."""

    model_config = ConfigDict(frozen=True)
    candidate: str
    deployed: str | None
    decision: Literal["promote", "refuse"]
    reasons: list[str]
    checks: list[Check]
    min_gain: float
    tie_max_cost_share: float = Field(default=TIE_MAX_COST_SHARE,
                                      description="A tie on a measure passed at or below this share of the cost")
    decided_by: list[str] = Field(default_factory=list,
                                  description="The rules that refused (and already_deployed, decision_mismatch), "
                                              "or every rule checked when promoted")
    fallback_provider: str = Field(description="The best single provider, handed to the gateway for fallbacks")
    eval_file: str
    decided_at: datetime
    promoted: bool = Field(default=False, description="The publisher accepted the promotion")
    publisher_error: str | None = None


def _quality(measure: str, policy: str, name: str | None, cand: Any, base: Any, *, min_gain: float,
             tie_max_cost_share: float, detectable: float | None = None) -> Check:
    """One (measure, baseline) comparison: a gain above ``min_gain``, or a tie at a fraction of the cost.
    ``detectable`` (the paired comparison's mde80) is reported beside it, never part of the rule."""
    c, b = cand.measure(measure), base.measure(measure)
    share = (cand.cost_per_query_usd / base.cost_per_query_usd) if base.cost_per_query_usd > 0 else None
    known = c.mean is not None and b.mean is not None
    gain = known and c.mean > b.mean + min_gain
    tie = (known and not gain and c.mean >= b.mean - TIE_EPS and share is not None
           and share <= tie_max_cost_share)
    return Check(measure=measure, baseline=policy, baseline_name=name, candidate_mean=c.mean, baseline_mean=b.mean,
                 n=c.n, passed=bool(gain or tie), cost_share=share, tie=bool(tie), detectable=detectable)


def _waive_for_replacement(report: EvalReport, checks: list[Check]) -> list[Check]:
    """The best-single checks waived when the deployed router fell below the best single provider on every
    measure and the candidate beats the deployed router on every measure; else ``checks`` as they are."""
    if report.inputs.deployed is None or DEPLOYED not in report.policies:
        return checks
    dep, best = report.policies[DEPLOYED], report.policies[BEST_SINGLE]
    paired = {c.measure: c for c in report.comparisons if (c.a, c.b) == (DEPLOYED, BEST_SINGLE)}

    def below(m: str) -> bool:  # below on the means, and the paired interval (when there is one) entirely below 0
        d, b = dep.measure(m).mean, best.measure(m).mean
        ci = paired[m].ci95 if m in paired else None
        return d is not None and b is not None and d < b and (ci is None or ci[1] < 0)

    fell = all(below(m) for m in MEASURES)
    beats_deployed = all(ch.passed and not ch.tie for ch in checks if ch.rule == "quality" and ch.baseline == DEPLOYED)
    if not (fell and beats_deployed):
        return checks
    return [ch.model_copy(update={"passed": True, "waived": True})
            if ch.rule == "quality" and ch.baseline == BEST_SINGLE and not ch.passed else ch for ch in checks]


def decide(report: EvalReport, *, min_gain: float = 0.0, eval_file: str = "", max_router_p99_ms: float | None = None,
           cost_min_gain: float = 0.02, max_fallback_share: float = 0.05,
           tie_max_cost_share: float = TIE_MAX_COST_SHARE) -> Decision:
    """Apply the rules to an eval report (pure)."""
    i = report.inputs
    cand = report.policies[CANDIDATE]
    baselines = [(BEST_SINGLE, i.best_single.provider)]
    if i.deployed is not None:
        baselines.append((DEPLOYED, i.deployed))
    if LINEAR in report.policies:
        baselines.append((LINEAR, report.policies[LINEAR].adapter))
    mde = {(c.b, c.measure): c.mde80 for c in report.comparisons if c.a == CANDIDATE}
    checks = []
    for measure in MEASURES:
        for policy, name in baselines:
            checks.append(_quality(measure, policy, name, cand, report.policies[policy], min_gain=min_gain,
                                   tie_max_cost_share=tie_max_cost_share, detectable=mde.get((policy, measure))))
    checks = _waive_for_replacement(report, checks)
    if max_router_p99_ms is not None:
        p99 = cand.router_p99_ms if cand.router_p99_ms is not None else float("inf")
        checks.append(Check(rule="latency", measure="router_p99_ms", baseline="limit",
                            baseline_name=f"{max_router_p99_ms:g} ms", candidate_mean=p99,
                            baseline_mean=max_router_p99_ms, n=cand.queries, passed=p99 <= max_router_p99_ms))
    share = sum(cand.fallbacks.values()) / cand.queries if cand.queries else 1.0
    checks.append(Check(rule="reliability", measure="fallback_share", baseline="limit",
                        baseline_name=f"{max_fallback_share:.0%}", candidate_mean=share, baseline_mean=max_fallback_share,
                        n=cand.queries, passed=share <= max_fallback_share))
    if i.deployed is not None:
        dep = report.policies[DEPLOYED]
        pays = all((c := cand.measure(m).mean) is not None and (d := dep.measure(m).mean) is not None
                   and c >= d + cost_min_gain for m in MEASURES)
        checks.append(Check(rule="cost", measure="cost_per_query_usd", baseline=DEPLOYED, baseline_name=i.deployed,
                            candidate_mean=cand.cost_per_query_usd, baseline_mean=dep.cost_per_query_usd,
                            n=cand.queries, passed=cand.cost_per_query_usd <= dep.cost_per_query_usd or pays))
    failed = [ch.line(min_gain) for ch in checks if not ch.passed]
    decided_by = sorted({ch.rule for ch in checks if not ch.passed}) or sorted(
        {ch.rule for ch in checks} | ({"replacement"} if any(ch.waived for ch in checks) else set()))
    if i.deployed is not None and i.deployed == i.candidate:
        failed.insert(0, f"{i.candidate} is already the deployed router")
        decided_by = ["already_deployed", *decided_by]
    if i.decision == "top-tier" and i.rates_from == "none" and i.untabled.get(i.candidate):
        failed.insert(0, f"{i.candidate} was evaluated without a top-tier table (no --publisher-url or --rates-file): "
                         f"{i.untabled[i.candidate]} of its answers were decided by the first choice, not as a "
                         "gateway deciding by top-tier decides; evaluate it again with --publisher-url")
        decided_by = ["decision_mismatch", *decided_by]
    reasons = failed or [ch.line(min_gain) for ch in checks]
    return Decision(candidate=i.candidate, deployed=i.deployed, decision="refuse" if failed else "promote",
                    reasons=reasons, checks=checks, min_gain=min_gain, tie_max_cost_share=tie_max_cost_share,
                    decided_by=decided_by,
                    fallback_provider=i.best_single.provider, eval_file=eval_file, decided_at=datetime.now(UTC))


def evidence(report: EvalReport, decision: Decision) -> dict[str, Any]:
    """What the publisher stores beside the promoted manifest: the eval summary and the decision."""
    return {"eval": report.summary(), "decision": decision.model_dump(mode="json")}


def write_decision(decision: Decision, out_dir: Path) -> Path:
    path = Path(out_dir) / "decision.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(decision.model_dump_json(indent=1) + "\n")
    return path


def render(decision: Decision) -> str:
    head = {"promote": f"PROMOTE {decision.candidate}", "refuse": f"REFUSED {decision.candidate}"}[decision.decision]
    if decision.decision == "promote" and not decision.promoted:
        head += " (decided, but the publisher did not accept it)"
    deployed = decision.deployed or "none"
    return "\n".join([f"{head} (deployed: {deployed}; fallback provider: {decision.fallback_provider}; "
                      f"decided by: {', '.join(decision.decided_by)})",
                      *(f"  - {r}" for r in decision.reasons)])
