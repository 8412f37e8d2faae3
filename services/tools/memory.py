"""The demo's memory watch: resident memory sampled through the run, its peak per step, a JSON and a PNG.

Why: the demo runs every service in one process; whether its steps fit a small machine is a figure
to read after every run, not a guess. The broker and redis-server the demo starts are its children
too; they are counted apart (``stack``), since a deployment runs them elsewhere.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common import rss
from services.tools import steps

#: descendants whose command line names one of these are the local stack, not the demo's own work
STACK_COMMANDS = ("java", "redis-server")


@dataclass
class Sample:
    """One reading: seconds since the start, the step then running, MiB of the demo and of the stack."""

    t: float
    step: str
    demo_mb: float
    stack_mb: float


@dataclass
class MemoryWatch:
    """Sample this process and its descendants every ``interval_s`` on a daemon thread."""

    interval_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def read(self) -> Sample:
        """One reading now (the demo: this process and its non-stack descendants)."""
        pid = os.getpid()
        demo, stack = rss.rss_mb(pid), 0.0
        for child in rss.descendants(pid):
            mb = rss.rss_mb(child)
            if any(word in rss.command_name(child) for word in STACK_COMMANDS):
                stack += mb
            else:
                demo += mb
        return Sample(round(time.monotonic() - self._t0, 2), steps.current(), round(demo, 1), round(stack, 1))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.read())

    def __enter__(self) -> MemoryWatch:
        self._t0 = time.monotonic()
        self.samples.append(self.read())
        self._thread = threading.Thread(target=self._loop, name="fanroute-memory-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.samples.append(self.read())

    def summary(self) -> dict:
        """Peak of the demo (and of the stack) overall and per step, in the order the steps ran."""
        per_step: dict[str, dict[str, float]] = {}
        for s in self.samples:
            row = per_step.setdefault(s.step, {"demo_peak_mb": 0.0, "stack_peak_mb": 0.0, "seconds": 0.0})
            row["demo_peak_mb"] = max(row["demo_peak_mb"], s.demo_mb)
            row["stack_peak_mb"] = max(row["stack_peak_mb"], s.stack_mb)
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            per_step[a.step]["seconds"] = round(per_step[a.step]["seconds"] + b.t - a.t, 1)
        peak = max(self.samples, key=lambda s: s.demo_mb)
        return {"demo_peak_mb": peak.demo_mb, "demo_peak_step": peak.step,
                "demo_plus_stack_peak_mb": max(s.demo_mb + s.stack_mb for s in self.samples),
                "stack_peak_mb": max(s.stack_mb for s in self.samples), "process_hwm_mb": rss.hwm_mb(),
                "interval_s": self.interval_s, "steps": per_step}

    def write(self, out_dir: Path) -> tuple[Path, Path | None]:
        """``memory.json`` (summary and every sample) and ``memory.png`` under ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        jpath = out_dir / "memory.json"
        jpath.write_text(json.dumps({**self.summary(), "samples": [s.__dict__ for s in self.samples]}, indent=1))
        return jpath, self._plot(out_dir / "memory.png")

    def _plot(self, path: Path) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(10, 4))
        t = [s.t / 60 for s in self.samples]
        ax.plot(t, [s.demo_mb / 1024 for s in self.samples], label="the demo (its Python processes)")
        ax.plot(t, [s.stack_mb / 1024 for s in self.samples], label="local Kafka + redis-server", alpha=0.6)
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            if b.step != a.step:
                ax.axvline(b.t / 60, color="grey", lw=0.5)
                ax.text(b.t / 60, ax.get_ylim()[1] * 0.97, b.step.split("]", 1)[0] + "]", fontsize=7, va="top")
        ax.set(xlabel="minutes since the start", ylabel="resident memory (GiB)", title="fanroute demo: memory")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def render(summary: dict) -> str:
    """The per-step table the demo prints at its end."""
    lines = [f"memory: the demo peaked at {summary['demo_peak_mb'] / 1024:.2f} GiB RSS during "
             f"{summary['demo_peak_step']} (local Kafka + Redis beside it: {summary['stack_peak_mb'] / 1024:.2f} GiB)",
             f"  {'step':<72} {'peak GiB':>9} {'minutes':>8}"]
    for name, row in summary["steps"].items():
        lines.append(f"  {name[:72]:<72} {row['demo_peak_mb'] / 1024:>9.2f} {row['seconds'] / 60:>8.1f}")
    return "\n".join(lines)
