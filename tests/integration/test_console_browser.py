"""The console in a real browser over the real broker: filter the trace list to contested, open a trace,
sign in, disagree with the judge and give an ordering; the ``reviews`` record lands on the topic and
``fanroute calibrate report --source reviews`` counts it; a run page draws its charts; the loop's cycles
read from the ``cycles`` topic are listed.

Screenshots go to ``$FANROUTE_SCREENSHOTS`` (the README's come from ``FANROUTE_SCREENSHOTS=docs/img``),
else to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from schemas import topic
from schemas.calibration import Review
from services.common.bus import Bus
from services.common.settings import KafkaSettings, RedisSettings
from services.console.app import create_app
from services.console.settings import ConsoleSettings
from services.judge.settings import JudgeSettings, build_backend
from tests.support.console import chromium, console_records, cycle_records, write_run
from tests.support.contract import ThreadServer
from tests.support.poll import eventually_sync
from tests.support.topics import topic_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "console-test-token"


async def _publish(kafka: KafkaSettings, traces, verdicts, cycles) -> None:
    bus = Bus(kafka, client_id="console-test")
    await bus.start((topic("traces"), topic("verdicts"), topic("cycles")))
    try:
        for t in traces:
            await bus.publish(topic("traces"), t)
        for v in verdicts:
            await bus.publish(topic("verdicts"), v)
        for c in cycles:
            await bus.publish(topic("cycles"), c)
    finally:
        await bus.stop()


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
        return json.load(r)


def test_a_reviewer_disagrees_in_the_browser_and_the_gate_counts_it(kafka_bootstrap, redis_url, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    shots = Path(os.environ.get("FANROUTE_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"console{uuid.uuid4().hex[:8]}.")
    backend = build_backend(JudgeSettings().judge)
    traces, verdicts = console_records(backend.identity.kind, backend.identity.model, backend.rubric)
    cycles = cycle_records()
    asyncio.run(_publish(kafka, traces, verdicts, cycles))
    write_run(tmp_path / "runs", finished=True)
    settings = ConsoleSettings(kafka=kafka, redis=RedisSettings(url=redis_url), console_token=TOKEN,
                               console_reviewer="alice", store_path=tmp_path / "console.sqlite3",
                               runs_dir=tmp_path / "runs", follow_poll_ms=200)
    driver = chromium()
    try:
        with ThreadServer(create_app(settings), "console") as server:
            def read_all() -> dict | None:
                health = _health(server.url)
                stored = health["stored"]
                done = (stored["traces"], stored["verdicts"], stored["cycles"]) == (len(traces), len(verdicts),
                                                                                  len(cycles))
                return health if done else None

            try:
                eventually_sync(read_all, timeout_s=60, what="the console to read every trace and verdict")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the console says {_health(server.url)}") from None
            driver.get(f"{server.url}/traces")
            assert len(driver.find_elements(By.CSS_SELECTOR, "tr.trace-row")) == 6
            Select(driver.find_element(By.ID, "f-contested")).select_by_value("true")
            driver.find_element(By.ID, "apply").click()
            WebDriverWait(driver, 30).until(ec.url_contains("contested=true"))  # the filtered page loaded
            rows = driver.find_elements(By.CSS_SELECTOR, "tr.trace-row")
            assert len(rows) == 2 and all("contested" in r.text for r in rows)
            driver.save_screenshot(str(shots / "console-traces.png"))
            trace_url = rows[0].find_element(By.CSS_SELECTOR, "a.trace-link").get_attribute("href")

            driver.get(f"{server.url}/login")
            driver.find_element(By.ID, "token").send_keys(TOKEN)
            driver.find_element(By.ID, "sign-in").click()
            WebDriverWait(driver, 30).until(ec.url_contains("/traces"))
            assert "signed in as alice" in driver.find_element(By.CSS_SELECTOR, "header").text
            driver.get(trace_url)
            assert driver.find_elements(By.CSS_SELECTOR, "#cand-good li.shared")  # good and flaky share citations
            verdict = driver.find_element(By.CSS_SELECTOR, "div.verdict")
            verdict.find_element(By.CSS_SELECTOR, "input.ordering").send_keys("flaky = good > cheap")
            verdict.find_element(By.CSS_SELECTOR, "button.disagree").click()
            review_line = WebDriverWait(driver, 30).until(
                ec.presence_of_element_located((By.CSS_SELECTOR, "p.review"))).text  # the redirect's page
            assert "alice" in review_line and "disagree" in review_line and "flaky = good > cheap" in review_line
            driver.save_screenshot(str(shots / "console-trace.png"))

            reviews = asyncio.run(topic_records(kafka, "reviews", Review))
            assert len(reviews) == 1
            r = reviews[0]
            assert (r.reviewer, r.mark, r.source) == ("alice", "disagree", "console")
            assert r.ordering == (("flaky", "good"), ("cheap",)) and r.trace_id == trace_url.rsplit("/", 1)[1]
            assert r.judge_key and r.verdict_id in {v.verdict_id for v in verdicts}

            driver.get(f"{server.url}/runs")
            driver.find_element(By.CSS_SELECTOR, "a.run-link").click()
            WebDriverWait(driver, 30).until(ec.url_contains("/run?id=train"))
            series = driver.find_elements(By.CSS_SELECTOR, "figure.chart svg g[id^='series-'] path")
            assert series, "no chart series was drawn"
            loss = driver.find_elements(By.CSS_SELECTOR, "g#series-loss path")
            assert loss and len(loss[0].get_attribute("d").split("L")) >= 12  # one vertex per logged step
            driver.save_screenshot(str(shots / "console-run.png"))

            driver.find_element(By.LINK_TEXT, "Cycles").click()
            WebDriverWait(driver, 30).until(ec.url_contains("/cycles"))
            states = [r.get_attribute("class") for r in driver.find_elements(By.CSS_SELECTOR, "#cycles tr[class^='cycle-']")]
            assert states == ["cycle-running", "cycle-skipped", "cycle-finished"], states
            assert "router@1 → router@2" in driver.find_element(By.ID, "cycles").text
            driver.save_screenshot(str(shots / "console-cycles.png"))
    finally:
        driver.quit()

    env = {**os.environ, "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
           "FANROUTE_KAFKA__TOPIC_NAMESPACE": kafka.topic_namespace, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "reviews-report.json"
    run = subprocess.run([sys.executable, "-m", "services.cli", "calibrate", "report", "--source", "reviews",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reviews: 1 (0 agree, 1 disagree); 1 compared" in run.stdout, run.stdout
    record = json.loads(out.read_text())["record"]
    assert record["human_source"] == "reviews" and record["n"] == 1
