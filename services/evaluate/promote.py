"""The promotion rule: a candidate router is promoted only when it beats the deployed router and the
best single provider on BOTH measures (the judge's grades and the humans' nDCG@10) on held-out data.

Strictly: candidate mean > baseline mean + ``min_gain`` for every (measure, baseline) pair; a measure
with no data (no held-out query has qrels, or the judge graded none) refuses, as does a candidate
that is already the deployed version.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.evaluate.metrics import MEASURES
from services.evaluate.policies import BEST_SINGLE, CANDIDATE, DEPLOYED
from services.evaluate.report import EvalReport

#: Exit status of ``fanroute promote`` when the rule refuses (0 = promoted, 2 = bad input, 1 = publisher failed).
EXIT_REFUSED = 3


class Check(BaseModel):
    """One (measure, baseline) comparison of the rule."""

    model_config = ConfigDict(frozen=True)
    measure: str
    baseline: str = Field(description="best_single or deployed")
    baseline_name: str | None = Field(description="The best single provider's or the deployed adapter's name")
    candidate_mean: float | None
    baseline_mean: float | None
    n: int
    passed: bool

    def line(self, min_gain: float) -> str:
        who = f"{self.baseline} ({self.baseline_name})"
        if self.candidate_mean is None or self.baseline_mean is None:
            return f"{self.measure}: no {self.measure} measure on the held-out queries (n={self.n}); cannot compare"
        verb = "beats" if self.passed else "does not beat"
        margin = f" by more than {min_gain:g}" if min_gain else ""
        return (f"{self.measure}: candidate {self.candidate_mean:.4f} {verb} {who} {self.baseline_mean:.4f}"
                f"{margin} (n={self.n})")


class Decision(BaseModel):
    """``decision.json``: what was decided, why, and the numbers compared."""

    model_config = ConfigDict(frozen=True)
    candidate: str
    deployed: str | None
    decision: Literal["promote", "refuse"]
    reasons: list[str]
    checks: list[Check]
    min_gain: float
    fallback_provider: str = Field(description="The best single provider, handed to the gateway for fallbacks")
    eval_file: str
    decided_at: datetime
    promoted: bool = Field(default=False, description="The publisher accepted the promotion")
    publisher_error: str | None = None


def decide(report: EvalReport, *, min_gain: float = 0.0, eval_file: str = "") -> Decision:
    """Apply the rule to an eval report (pure)."""
    i = report.inputs
    cand = report.policies[CANDIDATE]
    baselines = [(BEST_SINGLE, i.best_single.provider)]
    if i.deployed is not None:
        baselines.append((DEPLOYED, i.deployed))
    checks = []
    for measure in MEASURES:
        c = cand.measure(measure)
        for policy, name in baselines:
            b = report.policies[policy].measure(measure)
            ok = c.mean is not None and b.mean is not None and c.mean > b.mean + min_gain
            checks.append(Check(measure=measure, baseline=policy, baseline_name=name, candidate_mean=c.mean,
                                baseline_mean=b.mean, n=c.n, passed=ok))
    failed = [ch.line(min_gain) for ch in checks if not ch.passed]
    if i.deployed is not None and i.deployed == i.candidate:
        failed.insert(0, f"{i.candidate} is already the deployed router")
    reasons = failed or [ch.line(min_gain) for ch in checks]
    return Decision(candidate=i.candidate, deployed=i.deployed, decision="refuse" if failed else "promote",
                    reasons=reasons, checks=checks, min_gain=min_gain, fallback_provider=i.best_single.provider,
                    eval_file=eval_file, decided_at=datetime.now(UTC))


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
    return "\n".join([f"{head} (deployed: {deployed}; fallback provider: {decision.fallback_provider})",
                      *(f"  - {r}" for r in decision.reasons)])
