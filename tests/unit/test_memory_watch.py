"""The demo's memory watch and the /proc readings under it: a child's memory is counted, the stack's apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.common import rss
from services.tools import steps
from services.tools.memory import MemoryWatch, render

HOLD = "import sys; b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); " \
       "sys.stdin.read()"


def holding(mb: int) -> subprocess.Popen:
    """A child that touches ``mb`` MiB, says ready, and holds them until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(mb=mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def release(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_child_holding_memory_is_in_the_tree_and_gone_after_it_exits() -> None:
    child = holding(200)
    try:
        total, kids = rss.tree_rss_mb()
        assert kids[child.pid] > 190 and total > rss.rss_mb() + 190
        assert "bytearray" in rss.command_name(child.pid)
    finally:
        release(child)
    assert child.pid not in rss.tree_rss_mb()[1] and rss.rss_mb(child.pid) == 0.0
    assert (rss.hwm_mb() or 0) >= rss.rss_mb() > 0


def test_the_watch_attributes_each_step_its_peak_and_writes_json_and_png(tmp_path: Path) -> None:
    steps.reset()
    base = MemoryWatch().read()  # pytest's own children (a session broker, redis) are part of every reading
    with MemoryWatch(interval_s=0.05) as watch:
        steps.step(1, 2, "small")
        watch.samples.append(watch.read())
        steps.step(2, 2, "big (a child holds 150 MiB)")
        child = holding(150)
        watch.samples.append(watch.read())
        release(child)
    summary = watch.summary()
    small, big = summary["steps"]["[1/2] small"], summary["steps"]["[2/2] big"]
    assert big["demo_peak_mb"] > small["demo_peak_mb"] + 140
    assert summary["demo_peak_step"] == "[2/2] big" and summary["stack_peak_mb"] < base.stack_mb + 100
    jpath, ppath = watch.write(tmp_path)
    assert json.loads(jpath.read_text())["demo_peak_mb"] == summary["demo_peak_mb"]
    assert ppath is not None and ppath.read_bytes()[:4] == b"\x89PNG"
    assert "peaked at" in render(summary) and "[2/2] big" in render(summary)
    steps.reset()


def test_the_stack_is_counted_apart(monkeypatch) -> None:
    monkeypatch.setattr("services.tools.memory.STACK_COMMANDS", ("bytearray",))
    base = MemoryWatch().read()
    child = holding(100)
    try:
        sample = MemoryWatch().read()
        assert sample.stack_mb > base.stack_mb + 90 and sample.demo_mb < base.demo_mb + 50
    finally:
        release(child)
