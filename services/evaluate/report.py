"""The eval report: its JSON shape (``eval.json``, read back by ``fanroute promote``), the stdout
table and the cost–quality plot."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.evaluate.baseline import BestSingle
from services.evaluate.ceiling import CollectionRow
from services.evaluate.ceiling import render as render_ceiling
from services.evaluate.frontier import FrontierReport
from services.evaluate.frontier import plot as plot_frontier
from services.evaluate.frontier import render as render_frontier
from services.evaluate.halves import HalfRow
from services.evaluate.halves import render as render_halves
from services.evaluate.inputs import EvalInputError
from services.evaluate.metrics import MEASURES, Paired, PolicyMetrics
from services.evaluate.policies import POLICIES, Outcome
from services.router.modes import Decision

NOTES = {
    "held_out": "fan-out traces whose normalised query text is not the user turn of any training episode",
    "human": "nDCG@10 of the results actually returned against the collection's qrels; queries without "
             "qrels (or with no relevant judgment) are left out of the human mean",
    "judge": "the judge's 0-3 UMBRELA grade of the answer returned, every provider's answer and the RRF-fused "
             "list graded blind in ONE call per query (a grade can depend on the other answers shown); a "
             "failed provider or an unanswered query counts 0",
    "fanout": "returns the RRF-fused list (services/providers/fusion.py); its judge number is the grade of that "
              "list shown to the judge as one more blind candidate; cost = sum, latency = slowest provider",
    "oracle": "best provider per query in hindsight, separately per measure (ties: cheapest, then by name); "
              "cost/latency of the human pick where there are qrels, else of the judge pick",
    "judge_oracle": "per query the judge's first provider (top grade; ties: cheapest, then by name): the best a "
                    "student distilled from this judge can do, measured on the human qrels",
    "routers": "router ordering, then the best single provider, then the rest, at most max_attempts calls, "
               "next one only when the trace shows the provider failed; a router failure (timeout, error, "
               "unparseable) is answered by the best single provider and counted under fallbacks; "
               "latency = router time + the called providers' latencies in sequence; cost = their sum",
    "best_single": "the best single provider chosen on the training episodes only, with the same failover",
    "linear": "TF-IDF (word 1-2 and character 3-5 grams) + logistic regression fitted on the training episodes' "
              "queries and cost-aware first choices (C by 5-fold cross-validation on those episodes only), "
              "deciding in-process by P(best) - λ · cost like the scoring router; router_ms is its decision time",
}


class JudgeRecord(BaseModel):
    """Who graded: the judge's identity and rubric."""

    model_config = ConfigDict(frozen=True)
    kind: str
    model: str
    endpoint: str | None = None
    rubric_version: str
    rubric_hash: str


class EvalInputs(BaseModel):
    """What the evaluation ran on."""

    model_config = ConfigDict(frozen=True)
    traces_source: str
    traces_read: int
    traces_unreadable: int = 0
    excluded: dict[str, int] = Field(description="Traces left out, by rule (trained_query = the training overlap)")
    held_out: int
    human_queries: int = Field(description="Held-out queries with qrels (the human mean's n)")
    judge_failed: int = Field(description="Held-out queries the judge could not grade (out of the judge mean)")
    train_episodes_file: str
    train_episodes: int
    candidate: str
    deployed: str | None
    deployed_source: Literal["auto", "explicit", "none"]
    deployed_fallback_provider: str | None = None
    router_url: str
    router_timeout_s: float
    router_max_tokens: int
    max_attempts: int
    judge: JudgeRecord
    best_single: BestSingle
    linear: dict[str, Any] | None = Field(default=None, description="The linear router: kind, C, cv accuracy, "
                                                                      "training label counts")
    cost_weight: float = Field(default=0.0, description="λ the router rows decide with")
    decision: Decision = Field(
        default="first-choice", description="What the router rows' expected quality was (routing.decision)")
    rates_from: Literal["publisher", "file", "none"] = Field(
        default="none", description="decision top-tier: where the routers' tables came from (--publisher-url, "
                                    "--rates-file); none: nowhere, so every LM answer was decided by the first choice")
    untabled: dict[str, int] = Field(
        default_factory=dict, description="decision top-tier: router → scored answers decided by the first choice "
                                          "instead, for want of a top-tier table (none: every answer had one)")
    seed: int
    notes: dict[str, str] = Field(default_factory=lambda: dict(NOTES))


class QueryRow(BaseModel):
    """One held-out query and every policy's outcome on it."""

    model_config = ConfigDict(frozen=True)
    trace_id: str
    query_id: str | None
    query: str
    outcomes: dict[str, Outcome]


class EvalReport(BaseModel):
    """``eval.json``."""

    model_config = ConfigDict(frozen=True)
    schema_version: Literal[1] = 1
    created_at: datetime
    inputs: EvalInputs
    policies: dict[str, PolicyMetrics]
    comparisons: list[Paired]
    queries: list[QueryRow] = Field(default_factory=list)
    frontier: dict[str, FrontierReport] = Field(
        default_factory=dict, description="Measure → the candidate's cost-quality curve over λ (scoring routers)")
    collections: list[CollectionRow] = Field(
        default_factory=list, description="The label ceiling per collection: judge-oracle vs the hindsight best")
    dev_halves: list[HalfRow] = Field(
        default_factory=list, description="The human figures on the held-out queries in each half of the dev "
                                          "queries: the one settings were tuned on, and the one nothing was")

    def summary(self) -> dict[str, Any]:
        """Everything but the per-query rows (the evidence stored beside a promotion)."""
        return self.model_dump(mode="json", exclude={"queries"})


def read_report(path: Path) -> EvalReport:
    """``eval.json`` back; a missing or malformed file is an :class:`EvalInputError` naming it."""
    path = Path(path)
    try:
        return EvalReport.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise EvalInputError(f"eval file {path} does not exist") from None
    except ValidationError as exc:
        raise EvalInputError(f"{path}: not an eval.json written by fanroute eval: {exc}") from exc


def write_json(report: EvalReport, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.json"
    path.write_text(report.model_dump_json(indent=1) + "\n")
    return path


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _label(m: PolicyMetrics, report: EvalReport) -> str:
    if m.adapter:
        return f"{m.policy} ({m.adapter})"
    if m.policy == "best_single":
        return f"best_single ({report.inputs.best_single.provider})"
    return m.policy


def render(report: EvalReport) -> str:
    """The stdout table, the oracle-gain shares and the paired comparisons."""
    i = report.inputs
    head = (f"{'policy':<28} {'nDCG@10':>8} {'judge':>6} {'calls/q':>8} {'cost/q $':>9} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'fallbacks':>9}")
    lines = [f"held-out fan-out traces: {i.held_out} (read {i.traces_read}; excluded "
             + ", ".join(f"{k} {v}" for k, v in i.excluded.items() if v) + ")"
             if any(i.excluded.values()) else f"held-out fan-out traces: {i.held_out} (read {i.traces_read})",
             f"human measure over {i.human_queries} queries with qrels; judge {i.judge.model} "
             f"(rubric {i.judge.rubric_hash[:8]}) over {i.held_out - i.judge_failed}",
             f"routers decide by {i.decision}, λ = {i.cost_weight:g}"
             + "".join(f"; {n}: {k} answers had no top-tier table (first choice)" for n, k in i.untabled.items()),
             head, "-" * len(head)]
    for name in POLICIES:
        m = report.policies.get(name)
        if m is None:
            continue
        fb = sum(m.fallbacks.values())
        lines.append(f"{_label(m, report):<28} {_num(m.human.mean, '.3f'):>8} {_num(m.judge.mean, '.2f'):>6} "
                     f"{m.calls_per_query:>8.2f} {m.cost_per_query_usd:>9.4f} {m.latency_p50_ms:>8.0f} "
                     f"{m.latency_p99_ms:>8.0f} {fb if m.adapter else '-':>9}")
    for name in ("candidate", "deployed", "linear"):
        m = report.policies.get(name)
        if m is not None:
            share = ", ".join(f"{k} {_num(v, '.1%')}" for k, v in m.oracle_gain_share.items())
            kinds = ", ".join(f"{k} {v}" for k, v in m.fallbacks.items()) or "none"
            lines.append(f"{name}: share of the oracle's gain over best_single recovered: {share}; "
                         f"fallbacks: {kinds}")
            lines += [f"  first {k}: {v[:160]}" for k, v in m.fallback_examples.items()]
    for c in report.comparisons:
        ci = f" [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}]" if c.ci95 else ""
        power = f"; {c.n} queries detect |Δ| ≥ {c.mde80:.3f} with 80 % power" if c.mde80 is not None else ""
        if c.n_needed is not None and c.ci95 is not None and c.ci95[0] <= 0 <= c.ci95[1]:  # n_needed: n ≥ 2
            power += f", the observed difference needs ≈ {c.n_needed:,} queries"
        lines.append(f"{c.a} - {c.b} on {c.measure}: {_num(c.mean_diff, '+.3f')}{ci} over {c.n} "
                     f"(wins/ties/losses {c.wins}/{c.ties}/{c.losses}){power}")
    for curve in report.frontier.values():
        lines += ["", f"candidate over λ, {render_frontier(curve)}"]
    lines += render_halves(report.dev_halves)
    lines += render_ceiling(report.collections)
    return "\n".join(lines)


def write_plot(report: EvalReport, out_dir: Path) -> Path:
    """``cost_quality.png``: two panels (human, judge), x = cost per query, one labelled point per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.tools.report import plot_cost_quality

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = {"human": "nDCG@10 vs human qrels", "judge": f"judge grade (0-3, {report.inputs.judge.model})"}
    for ax, measure in zip(axes, MEASURES):
        points = [(_label(m, report), m.cost_per_query_usd, m.measure(measure).mean)
                  for m in report.policies.values() if m.measure(measure).mean is not None]
        plot_cost_quality(ax, points, labels[measure])
        ax.margins(x=0.15, y=0.2)  # room for stacked labels
        ax.set_title(f"{measure}: {report.inputs.held_out} held-out queries")
    fig.suptitle("fanroute eval: cost–quality of routers and baselines")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cost_quality.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    if report.frontier:
        plot_frontier(list(report.frontier.values()), out_dir / "frontier.png")
    return path
