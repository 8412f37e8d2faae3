"""The console's HTTP surface on the in-memory bus: bad input is a clear 4xx and stores nothing; a signed-in
agree is published on ``reviews`` and stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas import topic
from schemas.calibration import Review
from services.common.settings import KafkaSettings, RedisSettings
from services.console.app import COOKIE, Console, create_app
from services.console.settings import ConsoleSettings
from tests.support.console import cycle_records, write_run
from tests.support.records import trace, verdict_for

TOKEN = "unit-console-token"
HTML = {"accept": "text/html"}


def _settings(tmp_path: Path, token: str | None = TOKEN) -> ConsoleSettings:
    return ConsoleSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                           console_token=token, console_reviewer="alice", store_path=tmp_path / "console.sqlite3",
                           runs_dir=tmp_path / "runs", max_body_bytes=1024)


def _client(tmp_path: Path, token: str | None = TOKEN) -> Iterator[tuple[TestClient, Console]]:
    settings = _settings(tmp_path, token)
    console = Console(settings)
    assert console.memory  # no follower: the test fills the store itself
    console.store.put(trace("t-1", query="what is a cell"))
    console.store.put(verdict_for("t-1", grades={"a": 3, "b": 1}))
    write_run(tmp_path / "runs")
    with TestClient(create_app(settings, console), follow_redirects=False) as client:
        yield client, console


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, Console]]:
    yield from _client(tmp_path)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[TestClient, Console]]:
    yield from _client(tmp_path, token=None)


def _verdict_id() -> str:
    return verdict_for("t-1", grades={"a": 3, "b": 1}).verdict_id


def _review(client: TestClient, *, signed_in: bool = True, **form: str) -> object:
    client.cookies.clear()
    if signed_in:
        client.cookies.set(COOKIE, TOKEN)
    return client.post("/reviews", data={"verdict_id": _verdict_id(), "mark": "agree", **form})


def test_unknown_trace_is_a_404_page_for_a_browser_and_json_otherwise(app):
    client, _ = app
    page = client.get("/traces/nope", headers=HTML)
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert "no trace &#39;nope&#39;" in page.text and "Nothing was stored" in page.text
    api = client.get("/traces/nope")
    assert api.status_code == 404
    assert api.json()["error"] and "no trace 'nope'" in api.json()["reason"]


@pytest.mark.parametrize(("query", "field"), [
    ("contested=maybe", "contested"), ("judged=yes", "judged"), ("since=not-a-date", "since"),
    ("since=2026-02-31", "since"), ("until=2026-13-01", "until"), ("page=0", "page"), ("page=x", "page"),
])
def test_a_malformed_filter_is_a_422_naming_the_field(app, query, field):
    client, _ = app
    r = client.get(f"/traces?{query}")
    assert r.status_code == 422, r.text
    assert field in r.json()["reason"]
    page = client.get(f"/traces?{query}", headers=HTML)
    assert page.status_code == 422 and field in page.text


def test_the_filters_that_are_well_formed_answer(app):
    client, _ = app
    r = client.get("/traces?contested=false&provider=a&q=CELL&since=2020-01-01&until=2100-01-01T00:00Z")
    assert r.status_code == 200 and "/traces/t-1" in r.text
    assert "/traces/t-1" not in client.get("/traces?contested=true").text


def test_an_oversized_body_is_a_413_and_nothing_is_stored(app):
    client, console = app
    r = _review(client, note="x" * 4000)
    assert r.status_code == 413
    assert console.store.counts()["reviews"] == 0


def test_a_review_of_a_verdict_that_does_not_exist_is_a_404_and_nothing_is_stored(app):
    client, console = app
    client.cookies.set(COOKIE, TOKEN)
    r = client.post("/reviews", data={"verdict_id": "no-such-verdict", "mark": "agree"}, headers=HTML)
    assert r.status_code == 404 and "no verdict" in r.text
    assert console.store.counts()["reviews"] == 0 and not console.bus_started


def test_without_a_token_configured_reviews_and_sign_in_are_403(read_only):
    client, console = read_only
    assert _review(client, signed_in=False).status_code == 403
    assert client.post("/login", data={"token": TOKEN}).status_code == 403
    assert console.store.counts()["reviews"] == 0


def test_no_or_a_wrong_sign_in_is_a_401(app):
    client, console = app
    assert _review(client, signed_in=False).status_code == 401
    client.cookies.set(COOKIE, "wrong")
    assert client.post("/reviews", data={"verdict_id": _verdict_id(), "mark": "agree"}).status_code == 401
    assert client.post("/login", data={"token": "wrong"}).status_code == 401
    assert console.store.counts()["reviews"] == 0


@pytest.mark.parametrize(("ordering", "says"), [("", "required"), ("a > zz", "zz")])
def test_a_disagree_without_a_valid_ordering_is_a_422(app, ordering, says):
    client, console = app
    r = _review(client, mark="disagree", ordering=ordering)
    assert r.status_code == 422
    assert "ordering" in r.json()["reason"] and says in r.json()["reason"]
    assert console.store.counts()["reviews"] == 0


def test_an_unknown_run_or_evaluation_is_a_404(app):
    client, _ = app
    for path in ("/run?id=no/such/run", "/run/charts?id=no/such/run", "/eval?id=no/such/eval"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert "no/such" in r.json()["reason"]
    assert client.get("/run?id=train/run").status_code == 200  # the one that exists


def test_the_evaluation_page_shows_each_comparisons_interval_and_power_and_reads_older_reports(app, tmp_path):
    from services.evaluate.metrics import paired
    from services.evaluate.policies import Outcome

    def outs(policy: str, human: list[float]) -> list[Outcome]:
        return [Outcome(policy=policy, called=("a",), returned="a", cost_usd=0.001, latency_ms=5.0, human=h,
                        judge=None) for h in human]

    c = paired("candidate", "linear", "human", outs("candidate", [0.5, 0.6, 0.4, 0.9]),
               outs("linear", [0.4, 0.6, 0.5, 0.7]), resamples=200)
    policies = {"candidate": {"human": {"mean": 0.6, "n": 4}, "judge": {"mean": None, "n": 0},
                              "cost_per_query_usd": 0.001, "queries": 4, "fallbacks": {}}}
    older = {"a": "candidate", "b": "best_single", "measure": "judge", "n": 0, "mean_diff": None,
             "wins": 0, "ties": 0, "losses": 0, "ci95": None}  # before the power fields; no interval at n = 0
    for name, comparisons in (("now", [c.model_dump(mode="json")]), ("older", [older])):
        (tmp_path / "runs" / "evals" / name).mkdir(parents=True)
        (tmp_path / "runs" / "evals" / name / "eval.json").write_text(
            json.dumps({"policies": policies, "comparisons": comparisons}))
    client, _ = app
    r = client.get("/eval?id=evals/now", headers=HTML)
    assert r.status_code == 200, r.text
    assert c.ci95 is not None and c.mde80 is not None and c.n_needed is not None
    for shown in (f"[{c.ci95[0]:+.4f}, {c.ci95[1]:+.4f}]", f"<td class=\"num\">{c.mde80:.4f}</td>", f"{c.n_needed:,}",
                  "detectable |Δ| (80 % power)"):
        assert shown in r.text, shown
    r = client.get("/eval?id=evals/older", headers=HTML)
    assert r.status_code == 200, r.text
    assert "best_single" in r.text and 'id="dev-halves"' not in r.text  # an older report has no split


def test_the_evaluation_page_shows_the_split_by_dev_half(app, tmp_path):
    from services.evaluate.halves import by_dev_half
    from services.evaluate.policies import Outcome, QueryScores
    from tests.support.records import candidate
    from tests.support.records import trace as make_trace

    scored = [QueryScores(trace=make_trace(f"t{q}", [candidate("a")], query_id=f"adi/{q}"), human={"a": 1.0},
                          judge={"a": 2}) for q in ("1", "3")]  # adi/1: tuning half, adi/3: validation half

    def outs(policy: str, human: list[float]) -> list[Outcome]:
        return [Outcome(policy=policy, called=("a",), returned="a", cost_usd=0.001, latency_ms=5.0, human=h,
                        judge=2.0) for h in human]

    rows = by_dev_half(scored, {"candidate": outs("candidate", [0.3, 0.6]), "best_single": outs("best_single", [0.3, 0.4])},
                       {"candidate": "router@1"}, resamples=0)
    (tmp_path / "runs" / "evals" / "halves").mkdir(parents=True)
    (tmp_path / "runs" / "evals" / "halves" / "eval.json").write_text(json.dumps(
        {"policies": {}, "comparisons": [], "dev_halves": [r.model_dump(mode="json") for r in rows]}))
    client, _ = app
    r = client.get("/eval?id=evals/halves", headers=HTML)
    assert r.status_code == 200, r.text
    table = r.text.split('id="dev-halves"', 1)[1].split("</table>", 1)[0]
    assert "<td>tune</td>" in table and "<td>validation</td>" in table and "+50.0 %" in table and "+0.0 %" in table
    assert "nothing" in table and "0.600" in table
    for garbage in ("halves", [1, {"half": "tune"}, {"half": "tune", "human": "x"}]):  # a hand-edited report
        (tmp_path / "runs" / "evals" / "halves" / "eval.json").write_text(json.dumps(
            {"policies": {}, "comparisons": [], "dev_halves": garbage}))
        r = client.get("/eval?id=evals/halves", headers=HTML)
        assert r.status_code == 200 and 'id="dev-halves"' not in r.text, r.text


def test_a_signed_in_agree_is_published_and_stored(tmp_path):
    settings = _settings(tmp_path)
    console = Console(settings)
    console.store.put(trace("t-1", query="what is a cell"))
    console.store.put(verdict_for("t-1", grades={"a": 3, "b": 1}))
    published: list[Review] = []

    async def on_review(r: Review) -> None:
        published.append(r)

    console.bus.subscribe(topic("reviews"), on_review, group_id="unit-test")  # FastStream's in-memory broker
    with TestClient(create_app(settings, console), follow_redirects=False) as client:
        _agree(client, console, published)


def _agree(client: TestClient, console: Console, published: list[Review]) -> None:
    login = client.post("/login", data={"token": TOKEN})
    assert login.status_code == 303 and login.cookies.get(COOKIE) == TOKEN
    r = client.post("/reviews", data={"verdict_id": _verdict_id(), "mark": "agree", "note": "right"})
    assert r.status_code == 303 and r.headers["location"] == f"/traces/t-1#verdict-{_verdict_id()}"
    stored = console.store.reviews_of([_verdict_id()])
    assert len(stored) == 1
    review = stored[0]
    assert isinstance(review, Review)
    assert (review.reviewer, review.mark, review.note, review.source) == ("alice", "agree", "right", "console")
    assert review.trace_id == "t-1" and review.judge_key and review.ordering == ()
    assert published == [review]  # on the bus before the redirect (the in-memory broker delivers in the call)
    assert "alice" in client.get("/traces/t-1").text


def test_the_cycles_page_shows_each_cycle_newest_first_with_its_state_and_decision(app):
    client, console = app
    records = cycle_records()
    for r in records + records[:3]:  # a phase written again after a restart is the same record
        console.store.put(r)
    assert console.store.counts()["cycles"] == len(records)
    page = client.get("/cycles", headers=HTML)
    assert page.status_code == 200, page.text
    text = page.text
    assert text.index("router@3") < text.index("0 new episodes (&lt; 20)") < text.index("beats the deployed router")
    assert [s for s in ("running", "skipped", "finished") if f'cycle-{s}' in text] == ["running", "skipped", "finished"]
    assert "router@1 → router@2" in text and "promote" in text and "triggered" in text and "0.586" in text
    assert "candidate_human 0.445" in text and "238 (238)" in text
    only = client.get("/cycles?limit=1", headers=HTML).text
    assert "router@3" in only and "0 new episodes" not in only


@pytest.mark.parametrize("query", ["limit=0", "limit=501", "limit=many"])
def test_a_malformed_cycles_limit_is_a_422_naming_it(app, query):
    client, console = app
    r = client.get(f"/cycles?{query}")
    assert r.status_code == 422 and "limit" in r.json()["reason"], r.text


def test_the_cycles_page_says_how_to_run_one_when_there_is_none(app):
    client, _ = app
    page = client.get("/cycles", headers=HTML)
    assert page.status_code == 200 and "fanroute loop --once" in page.text


def test_an_unreadable_cycles_record_is_counted_past_and_loses_nothing_stored(app):
    """What the follower hands the store for a record that does not decode: no row, its offset passed."""
    from services.common.replay_topic import TopicRecord

    _, console = app
    first, second = cycle_records()[:2]
    console.store.ingest("cycles", [TopicRecord(first, b"k", 0, 0, 0)])
    stored = console.store.ingest("cycles", [TopicRecord(None, b"k", 0, 1, 0), TopicRecord(second, b"k", 0, 2, 0)])
    assert stored == 1 and console.store.offsets("cycles") == {0: 3}
    assert [r.phase for r in console.store.cycles(limit=5)[0]] == ["started", "trained"]
