"""The console in tests: judged ADI traces to show, a training run to chart, and headless chromium.

- :func:`console_records`: fan-out traces of ADI queries (two contested) and, for each, a verdict written
  as the configured judge (so ``calibrate report --source reviews`` compares them);
- :func:`write_run`: an SFT run directory whose ``metrics.jsonl`` has the trainer's shape;
- :func:`chromium`: Debian's chromium through its chromedriver, headless (Selenium).
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from schemas.base import content_id
from schemas.trace import Trace
from schemas.verdict import CandidateGrade, Verdict
from tests.support.records import adi_trace

ADI_QUERIES = ("1", "3", "4", "5", "6", "7")


def console_records(judge_kind: str, judge_model: str, rubric_hash: str) -> tuple[list[Trace], list[Verdict]]:
    """Six ADI traces received a minute apart (queries 1 and 3 contested), each with an ok verdict."""
    t0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    traces, verdicts = [], []
    for i, qid in enumerate(ADI_QUERIES):
        t = adi_trace(qid, trace_id=f"console-adi-{qid}")
        t = t.model_copy(update={"received_at": t0 + timedelta(minutes=i),
                                 "signals": t.signals.model_copy(update={"contested": i < 2})})
        traces.append(t)
        grades = {"good": 3, "flaky": 2, "cheap": 0}
        verdicts.append(Verdict(
            verdict_id=content_id("verdict", t.trace_id, judge_model, rubric_hash), trace_id=t.trace_id,
            judged_at=t.received_at + timedelta(seconds=5), judge_kind=judge_kind, judge_model=judge_model,
            rubric_version="umbrela-listwise-v1", rubric_hash=rubric_hash, status="ok", sampled_because="contested",
            grades=tuple(CandidateGrade(provider=p, letter="ABC"[n], grade=g) for n, (p, g) in enumerate(grades.items())),
            ordering=(("good",), ("flaky",), ("cheap",)), letters={"A": "good", "B": "flaky", "C": "cheap"}))
    return traces, verdicts


def write_run(root: Path, name: str = "train/run", steps: int = 12, finished: bool = True) -> Path:
    """A run directory: the config line, ``steps`` step lines, a ``test/`` line every 4 steps, the end line."""
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = [{"config": {"run": {"type": "sft", "target": "first"}, "lr": 1e-3}, "episodes": 40}]
    for s in range(1, steps + 1):
        lines.append({"step": s, "loss": 1.5 / s, "grad_norm": 1.0 + 0.1 * s, "lr": 1e-3 * (1 - s / steps),
                      "tokens_per_s": 200.0 + s})
        if s % 4 == 0:
            lines.append({"step": s, "test/route_agree": 0.5 + 0.03 * s, "test/route_grade": 1.8 + 0.05 * s,
                          "test/route_share/good": 0.6, "test/route_share/cheap": 0.4})
    if finished:
        lines.append({"event": "end", "step": steps, "steps": steps})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def chromium() -> Any:
    """A headless chromium WebDriver (Debian's ``chromium`` and ``chromedriver``, installed by bootstrap)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    driver.set_page_load_timeout(60)
    return driver


def cycle_records(t0: datetime | None = None) -> list[Any]:
    """Three loop cycles an hour apart: one promoted and finished, one skipped, one still training."""
    from schemas.cycle import CycleRecord, Drift, cycle_id, record_id

    t0 = t0 or datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    out: list[CycleRecord] = []

    def add(slot: datetime, phase: str, minute: int, **kw: Any) -> None:
        cid = cycle_id("router", "linear", slot)
        out.append(CycleRecord(record_id=record_id(cid, phase), cycle_id=cid, phase=phase, model_id="router",
                               kind="linear", slot=slot, at=slot + timedelta(minutes=minute), trigger="schedule",
                               code_version="v-test", **kw))

    drift = Drift(score=0.586, threshold=0.15, triggered=True, worst="web-lexical")
    s1, s2, s3 = (t0 + timedelta(hours=h) for h in range(3))
    base = {"episodes": 238, "new_episodes": 238, "adapter_in": "router@1", "drift": drift}
    add(s1, "started", 0, **base)
    add(s1, "trained", 1, **base, adapter_out="router@2")
    done = {**base, "adapter_out": "router@2", "figures": {"candidate_human": 0.445, "deployed_human": 0.109},
            "decision": "promote", "reasons": ("beats the deployed router on the held-out window",)}
    add(s1, "evaluated", 2, **done)
    add(s1, "promoted", 3, **done)
    add(s1, "finished", 3, **done, timings_s={"train": 17.5, "eval": 4.0})
    add(s2, "started", 0, episodes=238, new_episodes=0, adapter_in="router@2")
    add(s2, "skipped", 0, episodes=238, new_episodes=0, adapter_in="router@2", reason="0 new episodes (< 20)")
    add(s3, "started", 0, episodes=260, new_episodes=22, adapter_in="router@2")
    add(s3, "trained", 1, episodes=260, new_episodes=22, adapter_in="router@2", adapter_out="router@3")
    return out
