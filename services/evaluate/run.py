"""``fanroute eval``: load the held-out traces, ask the routers, judge and score, replay every policy."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.trace import Trace
from services.common.rewards import DEFAULT_COST_WEIGHT
from services.evaluate import policies as pol
from services.evaluate.baseline import choose_best_single
from services.evaluate.ceiling import per_collection
from services.evaluate.curves import candidate_curves, per_domain_choice
from services.evaluate.halves import by_dev_half
from services.evaluate.inputs import (
    EvalInputError,
    held_out,
    load_traces_file,
    topic_traces,
)
from services.evaluate.metrics import summarise
from services.evaluate.policies import QueryScores, RouterCall
from services.evaluate.report import EvalInputs, EvalReport, JudgeRecord, QueryRow
from services.evaluate.routers import ask_all, probe, split_served_name
from services.judge.settings import JudgeSettings
from services.router.modes import DEFAULT_DECISION, DEFAULT_MODE, Decision, RouterMode

log = logging.getLogger(__name__)


class EvalOptions(BaseModel):
    """Everything ``fanroute eval`` (and ``promote`` without ``--eval``) is told on the command line."""

    model_config = ConfigDict(frozen=True)
    train_episodes: Path = Field(description="Training episodes (the output of fanroute dataset)")
    candidate: str = Field(min_length=1, description="Served name of the candidate adapter, e.g. router@3")
    deployed: str = Field(default="auto", min_length=1, description="auto (ask the publisher), none, or a served name")
    publisher_url: str | None = None
    router_url: str = "http://127.0.0.1:8001"
    traces_file: Path | None = Field(default=None, description="Traces JSONL; None = the traces topic")
    since: datetime | None = None
    until: datetime | None = None
    router_timeout_s: float = Field(default=2.0, gt=0, le=600)
    router_max_tokens: int = Field(default=48, ge=1, le=1024)
    router_mode: RouterMode = Field(default=DEFAULT_MODE, description="How the routers are asked")
    router_kind: Literal["lm", "linear"] = Field(
        default="lm", description="lm: the adapters are asked at router_url; linear: published linear-router "
                                  "versions, pulled from publisher_url and asked in-process (as the gateway does)")
    cost_weight: float = Field(default=DEFAULT_COST_WEIGHT, ge=0, le=1e6,
                               description="λ of the routers' rows: expected quality − λ · cost (the curve sweeps λ)")
    decision: Decision = Field(default=DEFAULT_DECISION,
                               description="What the expected quality is, as the gateway's routing.decision")
    rates_file: Path | None = Field(
        default=None, description="A top-tier table (an adapter's top_tier_rates.json) for every LM router "
                                  "asked, instead of each version's from publisher_url; without either, top-tier "
                                  "decides by the first choice, as the gateway does for a version without one")
    max_attempts: int = Field(default=2, ge=1, le=32)
    concurrency: int = Field(default=1, ge=1, le=256)
    seed: int = 0
    resamples: int = Field(default=2000, ge=0, le=100_000)
    collections_dir: Path | None = None
    progress: bool = True


def resolve_deployed(opts: EvalOptions) -> tuple[str | None, Literal["auto", "explicit", "none"], str | None]:
    """(served name, how it was found, its promotion's fallback provider) of the deployed router."""
    if opts.deployed == "none":
        return None, "none", None
    if opts.deployed != "auto":
        split_served_name(opts.deployed)
        return opts.deployed, "explicit", None
    if not opts.publisher_url:
        raise EvalInputError("--deployed auto asks the publisher which version is promoted: give --publisher-url, "
                             "or --deployed none / --deployed <model_id>@<version>")
    from services.common.publisher_client import PublisherClient

    model_id, _ = split_served_name(opts.candidate)
    with PublisherClient(opts.publisher_url, timeout_s=30) as client:
        record = client.promoted(model_id)
    if record is None:
        return None, "auto", None
    return f"{model_id}@{record['version']}", "auto", record.get("fallback_provider")


async def run_eval(opts: EvalOptions, settings: JudgeSettings) -> EvalReport:
    """The whole evaluation; :class:`EvalInputError` (or another FanrouteError) on unusable input."""
    from services.judge.guard import guard
    from services.trainer.data import load_episodes_file

    split_served_name(opts.candidate)
    guard(settings)  # the judge must not be one of the providers it grades
    episodes = load_episodes_file(opts.train_episodes)
    best = choose_best_single(episodes)
    traces, unreadable, source = await _traces(opts, settings)
    held = held_out(traces, episodes, require=best.provider)
    if not held.traces:
        raise EvalInputError(f"no held-out fan-out trace to evaluate on: read {held.read} from {source}, "
                             f"excluded {held.excluded}")
    deployed, deployed_source, deployed_fallback = await asyncio.to_thread(resolve_deployed, opts)
    adapters = {pol.CANDIDATE: opts.candidate, **({pol.DEPLOYED: deployed} if deployed else {})}
    calls = await _ask_routers(opts, list(dict.fromkeys(adapters.values())), held.traces)
    # a linear candidate is the linear baseline itself (fitted on the same episodes): not compared with itself
    linear = await asyncio.to_thread(fit_linear, episodes, opts.seed) if opts.router_kind == "lm" else None
    if linear is not None:
        adapters[pol.LINEAR] = LINEAR_NAME
        calls[LINEAR_NAME] = linear_calls(linear, held.traces, opts.cost_weight, top_tier=opts.decision == "top-tier")
    untabled = without_table(calls, opts.decision)
    scored, judge = await _score(opts, settings, held.traces)
    outcomes, rows = replay(scored, adapters, calls, best.provider, opts.max_attempts)
    metrics, comparisons = summarise(outcomes, adapters, seed=opts.seed, resamples=opts.resamples)
    curves = candidate_curves(scored, calls[opts.candidate], metrics, best.provider,
                              per_domain_choice(episodes, traces, best.provider))
    inputs = EvalInputs(
        traces_source=source, traces_read=held.read, traces_unreadable=unreadable, excluded=held.excluded,
        held_out=len(held.traces), human_queries=sum(q.human is not None for q in scored),
        judge_failed=sum(q.judge is None for q in scored), train_episodes_file=str(opts.train_episodes),
        train_episodes=len(episodes), candidate=opts.candidate, deployed=deployed,
        deployed_source=deployed_source, deployed_fallback_provider=deployed_fallback,
        router_url=opts.router_url, router_timeout_s=opts.router_timeout_s,
        router_max_tokens=opts.router_max_tokens, max_attempts=opts.max_attempts, judge=judge,
        best_single=best, linear=linear.describe() if linear is not None else None, cost_weight=opts.cost_weight,
        decision=opts.decision, rates_from=rates_source(opts), untabled=untabled, seed=opts.seed)
    return EvalReport(created_at=datetime.now(UTC), inputs=inputs, policies=metrics, comparisons=comparisons,
                      queries=rows, frontier=curves, collections=per_collection(scored, outcomes),
                      dev_halves=by_dev_half(scored, outcomes, adapters, seed=opts.seed, resamples=opts.resamples))


#: The linear router's name in the report (it is fitted here, not served).
LINEAR_NAME = "linear:tfidf-logreg"


def fit_linear(episodes, seed: int):
    """The linear router on the training episodes, or None (logged in the report as absent) when they
    cannot train one (too few, one label)."""
    from services.router.linear import LinearRouterError, fit

    try:
        return fit(episodes, seed=seed)
    except LinearRouterError:
        return None


def linear_calls(router, traces: list[Trace], cost_weight: float, *, top_tier: bool = True) -> dict[str, RouterCall]:
    """trace id → the linear router's decision on that trace's query and providers, timed."""
    from services.router.linear import decide_timed

    out = {}
    for t in traces:
        ordering, scores, ms = decide_timed(router, t.query, [c.provider for c in t.candidates],
                                            {c.provider: c.cost_usd for c in t.candidates}, cost_weight,
                                            top_tier=top_tier)
        out[t.trace_id] = RouterCall(ordering=ordering, router_ms=round(ms, 3), scores=scores,
                                     rates=router.rates if top_tier else None)
    return out


async def _traces(opts: EvalOptions, settings: JudgeSettings) -> tuple[list[Trace], int, str]:
    """(traces, unreadable records, where they came from): the file, or the topic between the times."""
    if opts.traces_file is not None:
        return load_traces_file(opts.traces_file), 0, f"file {opts.traces_file}"
    traces, unreadable = await topic_traces(settings.kafka, opts.since, opts.until)
    lo = opts.since.isoformat() if opts.since else "-inf"
    hi = opts.until.isoformat() if opts.until else "now"
    source = f"topic {settings.kafka.topic_namespace}traces appended in [{lo}, {hi})"
    return traces, unreadable, source


async def _ask_routers(opts: EvalOptions, names: list[str], traces: list[Trace]) -> dict[str, dict[str, RouterCall]]:
    """adapter name → trace id → its answer; each adapter is probed first (404 or unreachable: bad input)."""
    from services.router.client import RouterClient

    first = traces[0]
    providers = [c.provider for c in first.candidates]
    if opts.router_kind == "linear":
        return await _ask_linear(opts, names, traces)
    for name in names:
        await probe(opts.router_url, name, providers, first.query, mode=opts.router_mode)
    calls: dict[str, dict[str, RouterCall]] = {}
    source = rates_source(opts)
    local = local_rates(opts.rates_file) if source == "file" and opts.rates_file is not None else None
    rates_from = opts.publisher_url if source == "publisher" else None
    async with RouterClient(opts.router_url, timeout_s=opts.router_timeout_s, max_tokens=opts.router_max_tokens,
                            mode=opts.router_mode, rates_from=rates_from) as client:
        for name in names:
            asked = await ask_all(client, name, traces, concurrency=opts.concurrency, progress=opts.progress)
            if local is not None:
                asked = {tid: replace(c, rates=local) for tid, c in asked.items()}
            calls[name] = with_cost_weight(asked, traces, opts.cost_weight, opts.decision)
            if any(c.error_kind == "router_error" for c in calls[name].values()):
                # An error may be the router's or the server's: a server that went away (or stopped
                # serving the adapter) spoils the measurement rather than measuring the router.
                await probe(opts.router_url, name, providers, first.query, mode=opts.router_mode)
    return calls


def rates_source(opts: EvalOptions) -> Literal["publisher", "file", "none"]:
    """Where a top-tier evaluation's tables come from (an LM router's file first, as asked)."""
    if opts.decision != "top-tier":
        return "none"
    if opts.rates_file is not None and opts.router_kind == "lm":
        return "file"
    return "publisher" if opts.publisher_url else "none"


def without_table(calls: dict[str, dict[str, RouterCall]], decision: Decision) -> dict[str, int]:
    """Router → its scored answers that had no top-tier table, so were decided by the first choice (as a
    gateway decides for a version that published none); each such router is warned about."""
    if decision != "top-tier":
        return {}
    out = {}
    for name, asked in calls.items():
        scored = [c for c in asked.values() if c.scores and c.error_kind is None]
        if missing := sum(c.rates is None for c in scored):
            out[name] = missing
            log.warning("decision top-tier: %d of %d scored answers of %s had no top-tier table (no --publisher-url "
                        "or --rates-file, or the version published none) and were decided by the first choice",
                        missing, len(scored), name)
    return out


def local_rates(path: Path) -> dict[str, dict[str, float]]:
    """The top-tier table in ``path``; :class:`EvalInputError` naming the file and what is wrong."""
    from services.router.rates import from_json

    try:
        return from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # RatesError and JSONDecodeError are ValueErrors
        raise EvalInputError(f"--rates-file {path}: {exc}") from exc


async def _ask_linear(opts: EvalOptions, names: list[str], traces: list[Trace]) -> dict[str, dict[str, RouterCall]]:
    """The linear-router versions asked in this process, pulled from the publisher as the gateway pulls them."""
    from services.router.client import RouterError
    from services.router.linear_client import LinearRouterClient

    if not opts.publisher_url:
        raise EvalInputError("--router-kind linear pulls the versions from the publisher: give --publisher-url")
    client = LinearRouterClient(opts.publisher_url, timeout_s=opts.router_timeout_s)
    calls: dict[str, dict[str, RouterCall]] = {}
    try:
        for name in names:
            try:
                await client.prepare(name)
            except RouterError as exc:
                raise EvalInputError(f"linear router {name!r} cannot be loaded from {opts.publisher_url}: {exc}") from exc
            calls[name] = with_cost_weight(await ask_all(client, name, traces, concurrency=opts.concurrency,  # type: ignore[arg-type]
                                                         progress=opts.progress), traces, opts.cost_weight, opts.decision)
    finally:
        await client.close()
    return calls


def with_cost_weight(calls: dict[str, RouterCall], traces: list[Trace], cost_weight: float,
                     decision: Decision = DEFAULT_DECISION) -> dict[str, RouterCall]:
    """Scored calls re-ordered by expected quality − λ · cost, each provider's cost as its trace says (what
    the gateway does with the same scores and the same decision)."""
    from services.router.scoring import decide

    by_id = {t.trace_id: t for t in traces}
    out = {}
    for tid, c in calls.items():
        if c.scores and c.error_kind is None:
            rates = c.rates if decision == "top-tier" else None
            c = replace(c, rates=rates, ordering=decide(c.scores, {x.provider: x.cost_usd
                                                                   for x in by_id[tid].candidates}, cost_weight, rates))
        out[tid] = c
    return out


async def _score(opts: EvalOptions, settings: JudgeSettings,
                 traces: list[Trace]) -> tuple[list[QueryScores], JudgeRecord]:
    """Every trace with its human and judge scores, and who judged."""
    from services.evaluate.scoring import human_scores, judge_all
    from services.judge.calibration.human import QrelsStore
    from services.judge.guard import provider_hosts
    from services.judge.rubric import RUBRIC_VERSION
    from services.judge.settings import build_backend

    backend = build_backend(settings.judge)
    await backend.start()
    try:
        grades = await judge_all(backend, traces, hide=provider_hosts(settings), concurrency=opts.concurrency,
                                 progress=opts.progress)
    finally:
        await backend.close()
    store = QrelsStore(opts.collections_dir)
    ident = backend.identity
    judge = JudgeRecord(kind=ident.kind, model=ident.model, endpoint=ident.endpoint, rubric_version=RUBRIC_VERSION,
                        rubric_hash=backend.rubric)
    return [QueryScores(t, human_scores(t, store), grades[t.trace_id]) for t in traces], judge


def replay(scored: list[QueryScores], adapters: dict[str, str], calls: dict[str, dict[str, RouterCall]],
           best_single: str, max_attempts: int) -> tuple[dict[str, list[pol.Outcome]], list[QueryRow]]:
    """Every policy's outcome on every query: one list per policy (aligned by query) and one row per query."""
    outcomes: dict[str, list[pol.Outcome]] = {p: [] for p in (*adapters, pol.BEST_SINGLE, pol.JUDGE_ORACLE, pol.ORACLE,
                                                              pol.FANOUT)}
    rows = []
    for q in scored:
        tid = q.trace.trace_id
        per = {p: pol.routed(q, p, calls[name][tid], best_single, max_attempts) for p, name in adapters.items()}
        per[pol.BEST_SINGLE] = pol.single(q, best_single, max_attempts)
        per[pol.JUDGE_ORACLE] = pol.judge_oracle(q)
        per[pol.ORACLE] = pol.oracle(q)
        per[pol.FANOUT] = pol.fanout(q)
        for p, o in per.items():
            outcomes[p].append(o)
        rows.append(QueryRow(trace_id=tid, query_id=q.trace.query_id, query=q.trace.query, outcomes=per))
    return outcomes, rows
