"""The console's pages: traces (with agree/disagree under each verdict), runs, evaluations, adapters.

Server-rendered (Jinja2), progressively enhanced with htmx (a live run page redraws its charts; every form
works without script). Reads only the store the follower fills and the run directories; writes only
``reviews`` records, and only for a signed-in reviewer (``FANROUTE_CONSOLE_TOKEN``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException

from schemas.calibration import Review, review_id
from schemas.topics import topic
from services.common.bus import Bus
from services.common.errors import BusError
from services.common.http import BodyLimit, error
from services.common.ndcg import parse_ordering
from services.common.openapi import install_contract
from services.common.settings import secret_value
from services.common.stamps import stamp_store
from services.console import artifacts, charts, views
from services.console.ingest import Follower
from services.console.settings import ConsoleSettings
from services.console.store import ConsoleStore, TraceFilter
from services.providers.human import QrelsStore

HERE = Path(__file__).resolve().parent
COOKIE = "fanroute_console"
#: What the time filters take: empty (not filtered), a date, or a date and time (a browser's datetime-local
#: sends minutes only) with an optional offset. A day past its month's end matches and is refused (422).
_ISO = (r"^$|^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
        r"(T([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d{1,6})?)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)?)?$")
_HTML = "text/html"
Page = HTMLResponse
#: A run's id in a page's query: its path under the runs directory (``?id=demo/train/run``).
RunId = Annotated[str, Query(alias="id", min_length=1, max_length=1024,
                             description="The run's path under the runs directory")]


class Console:
    """The console's state: the store, the follower, the bus reviews go out on, the Redis stamps."""

    def __init__(self, settings: ConsoleSettings, store: ConsoleStore | None = None) -> None:
        self.settings = settings
        self.store = store or ConsoleStore(settings.store_path)
        self.memory = settings.kafka.bootstrap_servers == "memory://"
        self.follower = Follower(settings.kafka, self.store, settings.follow_poll_ms)
        self.bus = Bus(settings.kafka, client_id="fanroute-console")
        self.bus_started = False
        self.stamps = stamp_store(settings.redis.url, settings.kafka.topic_namespace)
        self.qrels = QrelsStore()

    async def start(self) -> None:
        if not self.memory:
            await self.follower.start()

    async def stop(self) -> None:
        await self.follower.stop()
        if self.bus_started:
            await self.bus.stop()
        await self.stamps.close()
        self.store.close()

    async def publish_review(self, review: Review) -> None:
        """On the ``reviews`` topic (acks=all), then in the store at once (the follower re-reads it: same id)."""
        if not self.bus_started:
            await self.bus.start((topic("reviews"),))
            self.bus_started = True
        await self.bus.publish(topic("reviews"), review)
        self.store.put(review)


def _wants_html(request: Request) -> bool:
    return _HTML in request.headers.get("accept", "")


def create_app(settings: ConsoleSettings, console: Console | None = None) -> FastAPI:
    """The FastAPI app over ``console`` (built from ``settings`` when not given)."""
    from services.common.http import lifespan_of

    console = console or Console(settings)
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals.update(settings=settings, fmt_ms=_fmt_ms)
    app = FastAPI(title="fanroute console", version="1", lifespan=lifespan_of(console),
                  description="The operator console: traces and verdicts with agree/disagree, runs, evaluations, "
                              "adapters. HTML pages; errors are JSON unless the client accepts text/html.")
    app.state.console = console

    def render(request: Request, status: int, kind: str, reason: str, headers: Mapping[str, str] | None) -> Response:
        if _wants_html(request):
            response: Response = templates.TemplateResponse(request, "error.html", {"status": status, "kind": kind,
                                                            "reason": reason, **_session(request)},
                                                            status_code=status)
        else:
            response = error(status, kind, reason)
        if headers:
            response.headers.update(headers)
        return response

    def html_errors(doc: dict[str, Any]) -> None:
        for item in doc.get("paths", {}).values():
            for op in item.values():
                for status, entry in op.get("responses", {}).items():
                    if status[0] in "45":
                        entry.setdefault("content", {})[_HTML] = {"schema": {"type": "string"}}

    install_contract(app, render=render, patch=html_errors)
    app.add_middleware(BodyLimit, default=settings.max_body_bytes)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def _session(request: Request) -> dict[str, Any]:
        return {"signed_in": _signed_in(request), "reviewer": settings.console_reviewer,
                "writes": secret_value(settings.console_token) is not None}

    def _signed_in(request: Request) -> bool:
        token = secret_value(settings.console_token)
        if token is None:
            return False
        given = request.cookies.get(COOKIE) or request.headers.get("authorization", "").removeprefix("Bearer ")
        return bool(given) and secrets.compare_digest(given.encode(), token.encode())

    def page(request: Request, name: str, **ctx: Any) -> Response:
        return templates.TemplateResponse(request, name, {**ctx, **_session(request)})

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/traces", status_code=303)

    @app.get("/healthz", operation_id="health", summary="Liveness, what is stored, and how each topic is followed")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "stored": console.store.counts(),
                             "following": {k: vars(v) for k, v in console.follower.state.items()}})

    @app.get("/traces", response_class=Page, operation_id="list_traces", summary="Traces, newest first, filtered")
    async def traces(request: Request,
                     q: Annotated[str | None, Query(max_length=200, description="Text the query contains")] = None,
                     contested: Annotated[str | None, Query(pattern="^(|true|false)$",
                                                            description="true: only contested; false: only not")] = None,
                     judged: Annotated[str | None, Query(pattern="^(|true|false)$",
                                                         description="true: only with an ok verdict; false: without")] = None,
                     provider: Annotated[str | None, Query(max_length=128)] = None,
                     collection: Annotated[str | None, Query(max_length=64)] = None,
                     since: Annotated[str | None, Query(max_length=40, pattern=_ISO,
                                                        description="Received at or after (ISO 8601, UTC when it has "
                                                                    "no offset)")] = None,
                     until: Annotated[str | None, Query(max_length=40, pattern=_ISO,
                                                        description="Received before (ISO 8601)")] = None,
                     page_no: Annotated[int, Query(alias="page", ge=1, le=100_000)] = 1) -> Response:
        f = TraceFilter(q or None, _flag(contested), _flag(judged), provider or None, collection or None,
                        _when("since", since), _when("until", until))
        size = settings.page_size
        total = console.store.count_traces(f)
        rows = console.store.list_traces(f, limit=size, offset=(page_no - 1) * size)
        params = {k: v for k, v in request.query_params.items() if k != "page" and v != ""}
        return page(request, "traces.html", rows=rows, total=total, page_no=page_no, pages=max(1, -(-total // size)),
                    params=params, facets=console.store.facets(), f=f, counts=console.store.counts(),
                    following=console.follower.state)

    @app.get("/traces/{trace_id}", response_class=Page, operation_id="get_trace", summary="One trace",
             responses={404: {"description": "No such trace"}})
    async def trace(request: Request, trace_id: str) -> Response:
        t = console.store.trace(trace_id)
        if t is None:
            raise HTTPException(404, f"no trace {trace_id!r} has been read from the traces topic")
        verdicts = console.store.verdicts_of(trace_id)
        reviews = console.store.reviews_of([v.verdict_id for v, _ in verdicts])
        return page(request, "trace.html", **views.trace_page(t, verdicts, reviews, console.qrels))

    @app.post("/reviews", response_class=RedirectResponse, operation_id="post_review", status_code=303,
              summary="Agree or disagree with one verdict (signed-in reviewers only)",
              responses={303: {"description": "Recorded; back to the trace"},
                         401: {"description": "Not signed in (no or a wrong token)"},
                         403: {"description": "This console has no token: it is read-only"},
                         404: {"description": "No such verdict"}, 422: {"description": "Invalid review"},
                         503: {"description": "Kafka did not take the record; nothing was stored"}})
    async def post_review(request: Request, verdict_id: Annotated[str, Form(min_length=1, max_length=128)],
                          mark: Annotated[Literal["agree", "disagree"], Form()],
                          ordering: Annotated[str, Form(max_length=2000)] = "",
                          note: Annotated[str, Form(max_length=4000)] = "") -> Response:
        if secret_value(settings.console_token) is None:
            raise HTTPException(403, "this console has no FANROUTE_CONSOLE_TOKEN: reviews are off")
        if not _signed_in(request):
            raise HTTPException(401, "sign in with the console's token first (/login)")
        found = console.store.verdict(verdict_id)
        if found is None:
            raise HTTPException(404, f"no verdict {verdict_id!r} has been read from the verdicts topic")
        verdict, judge_key = found
        tiers: tuple[tuple[str, ...], ...] = ()
        if mark == "disagree":
            if not ordering.strip():
                raise HTTPException(422, "ordering: required on a disagree (e.g. 'a = b > c', best first)")
            try:
                tiers = parse_ordering(ordering, [g.provider for g in verdict.grades])
            except ValueError as exc:
                raise HTTPException(422, f"ordering: {exc}") from None
        review = Review(review_id=review_id(verdict_id, settings.console_reviewer), verdict_id=verdict_id,
                        reviewer=settings.console_reviewer, mark=mark, note=note, created_at=datetime.now(UTC),
                        trace_id=verdict.trace_id, judge_key=judge_key, ordering=tiers, source="console")
        try:
            await console.publish_review(review)
        except BusError as exc:
            raise HTTPException(503, f"reviews topic: {exc}; nothing was stored, try again") from None
        return RedirectResponse(f"/traces/{verdict.trace_id}#verdict-{verdict_id}", status_code=303)

    @app.get("/login", response_class=Page, operation_id="login_form", summary="The sign-in form")
    async def login_form(request: Request) -> Response:
        return page(request, "login.html", failed=False)

    @app.post("/login", response_class=RedirectResponse, operation_id="login", status_code=303, summary="Sign in with the token",
              responses={303: {"description": "Signed in"}, 401: {"description": "Wrong token"},
                         403: {"description": "This console has no token"}})
    async def login(token: Annotated[str, Form(min_length=1, max_length=512)]) -> Response:
        want = secret_value(settings.console_token)
        if want is None:
            raise HTTPException(403, "this console has no FANROUTE_CONSOLE_TOKEN: reviews are off")
        if not secrets.compare_digest(token.encode(), want.encode()):
            raise HTTPException(401, "wrong token")
        response = RedirectResponse("/traces", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/runs", response_class=Page, operation_id="list_runs", summary="Training runs under the runs directory")
    async def runs(request: Request) -> Response:
        found = artifacts.scan(settings.runs_dir, "metrics.jsonl", settings.max_run_depth)
        return page(request, "runs.html", runs=[(f, artifacts.read_run(f)) for f in found])

    def _run(run_id: str) -> tuple[artifacts.Found, artifacts.Run]:
        for f in artifacts.scan(settings.runs_dir, "metrics.jsonl", settings.max_run_depth):
            if f.id == run_id:
                return f, artifacts.read_run(f)
        raise HTTPException(404, f"no run {run_id!r} under {settings.runs_dir}")

    drawn: dict[tuple[str, float], list[tuple[str, str]]] = {}  # (run, metrics.jsonl mtime) → its charts

    def _charts(found: artifacts.Found, run: artifacts.Run) -> list[tuple[str, str]]:
        """The run's charts, drawn again only when its metrics.jsonl changed (a few runs kept)."""
        key = (found.id, found.mtime)
        if key not in drawn:
            out = [(title, charts.line_chart(title, series)) for title, series in run.families()]
            if rewards := run.rewards():
                out.append(("reward distribution (last step)", charts.histogram("rewards", rewards, x_label="reward")))
            while len(drawn) >= 16:
                drawn.pop(next(iter(drawn)))
            drawn[key] = out
        return drawn[key]

    @app.get("/run/charts", response_class=Page, operation_id="run_charts",
             summary="A run's charts (the fragment a live page redraws)", responses={404: {"description": "No such run"}})
    async def run_charts(request: Request, run_id: RunId) -> Response:
        found, run = _run(run_id)
        return page(request, "run_charts.html", run=run, charts=await asyncio.to_thread(_charts, found, run))

    @app.get("/run", response_class=Page, operation_id="get_run", summary="One run's page",
             responses={404: {"description": "No such run"}})
    async def run_page(request: Request, run_id: RunId) -> Response:
        found, run = _run(run_id)
        return page(request, "run.html", run=run, charts=await asyncio.to_thread(_charts, found, run))

    @app.get("/evals", response_class=Page, operation_id="list_evals", summary="Evaluations and promotion decisions")
    async def evals(request: Request) -> Response:
        found = artifacts.scan(settings.runs_dir, "eval.json", settings.max_run_depth)
        return page(request, "evals.html", evals=[(f, artifacts.read_json(f.path / "decision.json")) for f in found])

    @app.get("/eval", response_class=Page, operation_id="get_eval", summary="One evaluation",
             responses={404: {"description": "No such evaluation"}})
    async def eval_page(request: Request, eval_id: Annotated[str, Query(alias="id", min_length=1, max_length=1024,
                                                                        description="The evaluation's path under the "
                                                                                    "runs directory")]) -> Response:
        for f in artifacts.scan(settings.runs_dir, "eval.json", settings.max_run_depth):
            if f.id == eval_id and (doc := artifacts.read_json(f.path / "eval.json")) is not None:
                ctx = views.eval_page(doc, artifacts.read_json(f.path / "decision.json"))
                planes = [(p, charts.cost_quality(f"{p['measure']}: cost–quality plane", p["points"], p["curve"],
                                                  p["hull"])) for p in ctx.pop("planes")]
                return page(request, "eval.html", eval_id=eval_id, planes=planes, **ctx)
        raise HTTPException(404, f"no evaluation {eval_id!r} under {settings.runs_dir}")

    @app.get("/cycles", response_class=Page, operation_id="list_cycles",
             summary="The continual loop's cycles, newest slot first: each phase, the decision, the drift")
    async def cycles(request: Request,
                     limit: Annotated[int, Query(ge=1, le=500, description="How many cycles to show")] = 50) -> Response:
        rows = views.cycles_page(await asyncio.to_thread(console.store.cycles, limit=limit))
        return page(request, "cycles.html", rows=rows, limit=limit, following=console.follower.state.get("cycles"))

    @app.get("/adapters", response_class=Page, operation_id="list_adapters", summary="Adapter versions")
    async def adapters(request: Request) -> Response:
        events = console.store.adapters()
        promoted, serving, stamps, redis_error = {}, {}, {}, None
        for model in sorted({e.model_id for e in events}):
            try:
                promoted[model] = await console.stamps.promoted(model)
                serving[model] = await console.stamps.serving(model)
                stamps[model] = await console.stamps.get(model)
            except Exception as exc:  # Redis away: the topic's history still shows
                redis_error = f"{type(exc).__name__}: {exc}"
        return page(request, "adapters.html", rows=views.adapters_page(events, promoted, serving, stamps),
                    redis_error=redis_error)

    return app


def _flag(value: str | None) -> bool | None:
    return None if not value else value == "true"


def _when(name: str, value: str | None) -> int | None:
    """An ISO 8601 time (UTC when it has no offset) as epoch ms; a 422 naming the field when it is not one."""
    if not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise HTTPException(422, f"{name}: not an ISO 8601 time: {value!r}") from None
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp() * 1000)


def _fmt_ms(ms: int | float | None) -> str:
    return "" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
