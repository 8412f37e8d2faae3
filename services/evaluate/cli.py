"""``fanroute eval``, ``fanroute promote`` and ``fanroute linear fit``: argument wiring; heavy modules
load after parsing."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.common.files import instant
from services.common.rewards import DEFAULT_COST_WEIGHT
from services.router.modes import DECISIONS, DEFAULT_DECISION, DEFAULT_MODE, MODES

EVAL_HELP = "compare a candidate router with the deployed one and the baselines on held-out fan-out traces"
PROMOTE_HELP = "promote a candidate router only if it beats the deployed one and the best single provider"
PROMOTE_EPILOG = ("exit status: 0 promoted; 3 refused by the rule (reasons printed and in decision.json); "
                  "2 bad input (files, names, an eval.json that does not match, publisher unreachable before "
                  "deciding, unknown version); 1 the publisher failed while promoting")


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be within 0..1, got {text}")
    return value


def _add_eval_arguments(p: argparse.ArgumentParser, *, train_required: bool) -> None:
    p.add_argument("--candidate", required=True, help="served name of the candidate adapter, e.g. router@3")
    p.add_argument("--train-episodes", type=Path, required=train_required,
                   help="the training episodes (fanroute dataset output): their queries are excluded and the "
                        "best single provider is chosen on them")
    p.add_argument("--traces", type=Path, default=None,
                   help="traces JSONL (default: the traces topic, see --since/--until)")
    p.add_argument("--since", type=instant, default=None, help="topic records appended at or after (ISO time)")
    p.add_argument("--until", type=instant, default=None, help="topic records appended before (ISO time)")
    p.add_argument("--deployed", default="auto",
                   help="the deployed router: auto (the publisher's promoted version), none, or a served name")
    p.add_argument("--publisher-url", default=None, help="publisher base URL (needed by --deployed auto)")
    p.add_argument("--router-url", default="http://127.0.0.1:8001",
                   help="OpenAI-compatible server of the adapters (the CPU sampler or vLLM)")
    p.add_argument("--router-timeout", type=float, default=2.0, help="deadline of one router call, seconds")
    p.add_argument("--router-max-tokens", type=int, default=48, help="greedy tokens the router may write (generate)")
    p.add_argument("--router-mode", choices=MODES, default=DEFAULT_MODE,
                   help="score: one completions call scores every provider name (vLLM prompt_logprobs), and the "
                        "candidate's cost-quality curve over λ is drawn; generate: the router writes its ordering")
    p.add_argument("--router-kind", choices=("lm", "linear"), default="lm",
                   help="lm: adapters served at --router-url; linear: linear-router versions pulled from "
                        "--publisher-url and asked in-process, as a gateway with routing.kind=linear asks them")
    p.add_argument("--cost-weight", type=_non_negative, default=DEFAULT_COST_WEIGHT,
                   help="λ of the routers' rows: choose by expected quality − λ · cost per call in USD (scoring)")
    p.add_argument("--decision", choices=DECISIONS, default=DEFAULT_DECISION,
                   help="top-tier: expected quality = P(in the judge's top tier), through each router's top-tier "
                        "table (an adapter's is pulled from --publisher-url); first-choice: P(the judge's "
                        "cost-aware first choice). As the gateway's routing.decision")
    p.add_argument("--rates-file", type=Path, default=None,
                   help="top-tier: this table (an adapter's top_tier_rates.json) for every adapter asked, instead "
                        "of each one's from --publisher-url")
    p.add_argument("--max-attempts", type=int, default=2, help="providers tried per query (failover)")
    p.add_argument("--concurrency", type=int, default=1, help="router and judge calls in flight")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=2000, help="paired bootstrap resamples (0 = no interval)")
    p.add_argument("--out", type=Path, default=Path("out/eval"), help="directory for eval.json and cost_quality.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``eval`` and ``promote`` on the ``fanroute`` subparsers."""
    e = sub.add_parser("eval", help=EVAL_HELP, description=EVAL_HELP)
    _add_eval_arguments(e, train_required=True)
    p = sub.add_parser("promote", help=PROMOTE_HELP, description=PROMOTE_HELP, epilog=PROMOTE_EPILOG)
    p.add_argument("--eval", type=Path, default=None,
                   help="an eval.json from fanroute eval (default: evaluate now with the eval arguments)")
    p.add_argument("--min-gain", type=_non_negative, default=0.0,
                   help="the candidate must beat each baseline by more than this on each measure")
    p.add_argument("--max-router-p99-ms", type=_non_negative, default=None,
                   help="the candidate router's own decision time must have p99 within this (default: no limit)")
    p.add_argument("--max-fallback-share", type=_share, default=0.05,
                   help="at most this share of the candidate's answers may be fallbacks (router errors, "
                        "timeouts, unparseable answers)")
    p.add_argument("--tie-max-cost-share", type=_share, default=0.5,
                   help="a tie with a baseline on a measure passes when the candidate costs at most this share "
                        "of it per query (0 disables ties; services.evaluate.promote.TIE_MAX_COST_SHARE)")
    p.add_argument("--cost-min-gain", type=_non_negative, default=0.02,
                   help="a candidate dearer per query than the deployed router must beat it by at least this "
                        "on both measures")
    _add_eval_arguments(p, train_required=False)
    lin = sub.add_parser("linear", help="the linear router (TF-IDF + logistic regression): fit it on training "
                                        "episodes and publish it as a servable router version")
    actions = lin.add_subparsers(dest="action", required=True)
    f = actions.add_parser("fit", help="fit on the episodes' queries and cost-aware first choices; write "
                                       f"<out>/linear_router.json; publish it with --publisher-url")
    f.add_argument("--train-episodes", type=Path, required=True, help="training episodes (fanroute dataset output)")
    f.add_argument("--out", type=Path, default=Path("out/linear"), help="directory for linear_router.json")
    f.add_argument("--publisher-url", default=None, help="publish the artifact as a version of --model-id")
    f.add_argument("--model-id", default="router-linear", help="the model id it is published under")
    f.add_argument("--seed", type=int, default=0, help="cross-validation seed")


def run(args: argparse.Namespace) -> int:
    """Dispatch; bad input is one line on stderr and exit 2."""
    from pydantic import ValidationError

    from services.common.errors import FanrouteError
    from services.judge.settings import JudgeSettings

    try:
        if args.cmd == "linear":
            return _linear_fit(args)
        settings = JudgeSettings()
        return _eval(args, settings) if args.cmd == "eval" else _promote(args, settings)
    except (FanrouteError, ValidationError) as exc:
        print(f"fanroute {args.cmd}: {exc}", file=sys.stderr)
        return 2


def _linear_fit(args: argparse.Namespace) -> int:
    """Fit, write the artifact, publish it when asked; prints what was fitted and the version published."""
    from services.evaluate.inputs import EvalInputError
    from services.router.linear import LinearRouterError, fit, write_artifact
    from services.trainer.data import load_episodes_file

    try:
        router = fit(load_episodes_file(args.train_episodes), seed=args.seed)
    except LinearRouterError as exc:
        raise EvalInputError(f"{args.train_episodes}: {exc}") from exc
    path = write_artifact(router, args.out)
    print(f"linear router: {router.train_episodes} episodes, labels {router.labels}, C {router.c:g}, "
          f"cross-validated accuracy {router.cv_accuracy:.3f} -> {path}")
    if args.publisher_url:
        from services.common.publisher_client import PublisherClient

        metrics = {"cv_accuracy": router.cv_accuracy, "train_episodes": float(router.train_episodes)}
        with PublisherClient(args.publisher_url) as client:
            msg = client.publish(args.model_id, args.out, "tfidf+logreg",
                                 {k: v for k, v in metrics.items() if v == v})  # NaN (unknown accuracy) left out
        print(f"published {msg['model_id']}@{msg['version']} ({msg['url']})")
    return 0


def _options(args: argparse.Namespace):
    from services.evaluate.inputs import EvalInputError
    from services.evaluate.run import EvalOptions

    if args.train_episodes is None:
        raise EvalInputError("--train-episodes is required to evaluate (or give --eval with an eval.json)")
    if args.traces is not None and (args.since or args.until):
        raise EvalInputError("--since/--until select records of the traces topic; they do not apply to --traces")
    return EvalOptions(train_episodes=args.train_episodes, candidate=args.candidate, deployed=args.deployed,
                       publisher_url=args.publisher_url, router_url=args.router_url, traces_file=args.traces,
                       since=args.since, until=args.until, router_timeout_s=args.router_timeout,
                       router_max_tokens=args.router_max_tokens, router_mode=args.router_mode,
                       router_kind=args.router_kind, cost_weight=args.cost_weight, decision=args.decision,
                       rates_file=args.rates_file, max_attempts=args.max_attempts,
                       concurrency=args.concurrency, seed=args.seed, resamples=args.bootstrap,
                       progress=not args.no_progress)


def _evaluate(args: argparse.Namespace, settings) -> Path:
    """Run the evaluation, print the table, write eval.json and the plot; returns eval.json's path."""
    from services.evaluate.report import render, write_json, write_plot
    from services.evaluate.run import run_eval

    report = asyncio.run(run_eval(_options(args), settings))
    print(render(report))
    path = write_json(report, args.out)
    plot = write_plot(report, args.out)
    print(f"wrote {path} and {plot}")
    return path


def _eval(args: argparse.Namespace, settings) -> int:
    _evaluate(args, settings)
    return 0


def _promote(args: argparse.Namespace, settings) -> int:
    from services.common.publisher_client import PublisherClient, PublisherClientError
    from services.evaluate.inputs import EvalInputError
    from services.evaluate.promote import (
        EXIT_REFUSED,
        decide,
        evidence,
        render,
        write_decision,
    )
    from services.evaluate.report import read_report
    from services.evaluate.routers import split_served_name

    model_id, version = split_served_name(args.candidate)
    if version is None:
        raise EvalInputError(f"--candidate {args.candidate!r} must name a version to promote (<model_id>@<version>)")
    if args.publisher_url is None:
        raise EvalInputError("--publisher-url is required to promote")
    eval_path = args.eval if args.eval is not None else _evaluate(args, settings)
    report = read_report(eval_path)
    if report.inputs.candidate != args.candidate:
        raise EvalInputError(f"{eval_path} evaluated {report.inputs.candidate}, not --candidate {args.candidate}")
    with PublisherClient(args.publisher_url, timeout_s=60) as client:
        current = client.promoted(model_id)
        current_name = f"{model_id}@{current['version']}" if current else None
        if current_name != report.inputs.deployed:
            raise EvalInputError(f"{eval_path} compared {args.candidate} with deployed "
                                 f"{report.inputs.deployed or 'none'}, but the publisher's promoted {model_id} "
                                 f"is now {current_name or 'none'}; evaluate again")
        decision = decide(report, min_gain=args.min_gain, eval_file=str(eval_path),
                          max_router_p99_ms=args.max_router_p99_ms, cost_min_gain=args.cost_min_gain,
                          max_fallback_share=args.max_fallback_share, tie_max_cost_share=args.tie_max_cost_share)
        status = 0 if decision.decision == "promote" else EXIT_REFUSED
        if decision.decision == "promote":
            try:
                client.promote(model_id, version, fallback_provider=decision.fallback_provider,
                               evidence=evidence(report, decision))
                decision = decision.model_copy(update={"promoted": True})
            except PublisherClientError as exc:
                decision = decision.model_copy(update={"publisher_error": str(exc)})
                status = 2 if exc.status == 404 else 1
    path = write_decision(decision, Path(eval_path).parent)
    print(render(decision))
    if decision.publisher_error:
        print(f"fanroute promote: the publisher refused or failed: {decision.publisher_error}", file=sys.stderr)
    print(f"decision -> {path}")
    return status
