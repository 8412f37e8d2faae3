"""Training runs and evaluations, found on disk where the trainer and ``fanroute eval`` write them.

A run is a directory with a ``metrics.jsonl`` (its first line the run's config, then one line per step and
per ``test/`` evaluation, an ``"event": "end"`` line when it finished); an evaluation is an ``eval.json``
with the ``decision.json`` that ``fanroute promote`` wrote beside it. Pages address them by their path
relative to the runs directory, and only a path the scan found is ever opened.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Chart families of a run page: title → the metric keys drawn in it (those a run has).
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss", "train/loss", "pg_loss")),
    ("reward", ("reward", "reward_mean", "train/reward", "test/reward")),
    ("routing on held-out episodes (test/)", ("test/route_agree", "test/route_best", "test/ndcg", "test/top1",
                                              "test/parse_ok")),
    ("routed judge grade (test/)", ("test/route_grade",)),
    ("KL", ("kl", "kl_per_sequence", "mismatch_kl", "kl_start")),
    ("trainer–sampler mismatch", ("mismatch", "mismatch_max")),
    ("entropy", ("entropy",)),
    ("tokens/s", ("tokens_per_s", "train/tokens_per_s")),
    ("sampler lag (steps behind)", ("lag_mean", "lag_max")),
    ("requeues and uniform groups", ("requeues", "requeues_total", "uniform_groups", "uniform_resampled",
                                     "test/uniform_groups")),
    ("grad norm", ("grad_norm",)),
    ("learning rate", ("lr",)),
)
_SKIP_DIRS = {".git", "blobs", "checkpoints", "sampler-cache", "tasks", "atif", "__pycache__", "node_modules"}


@dataclass(frozen=True)
class Found:
    """A run or an evaluation: its id (relative path), directory and last change."""

    id: str
    path: Path
    mtime: float


def scan(root: Path, name: str, max_depth: int) -> list[Found]:
    """Every file called ``name`` below ``root`` (at most ``max_depth`` levels), newest first."""
    out = []
    root = root.resolve()
    if not root.is_dir():
        return []
    for here, dirs, files in os.walk(root):
        depth = len(Path(here).relative_to(root).parts)
        dirs[:] = [] if depth >= max_depth else sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        if name in files:
            f = Path(here) / name
            rel = Path(here).relative_to(root).as_posix()
            out.append(Found(rel if rel != "." else "(root)", Path(here), f.stat().st_mtime))
    return sorted(out, key=lambda f: -f.mtime)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass
class Run:
    """One run's metrics: the config line, the step lines and the end line."""

    id: str
    kind: str
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    unreadable_lines: int = 0

    @property
    def finished(self) -> bool:
        return self.end is not None

    def series(self, key: str) -> list[tuple[float, float]]:
        """``(step, value)`` of one metric, in the order logged."""
        out = []
        for i, row in enumerate(self.rows):
            y = _number(row.get(key))
            if y is not None:
                out.append((_number(row.get("step")) or float(i), y))
        return out

    def families(self) -> list[tuple[str, dict[str, list[tuple[float, float]]]]]:
        """The chart families this run has data for, and their series."""
        out = []
        for title, keys in FAMILIES:
            series = {k: s for k in keys if (s := self.series(k))}
            if series:
                out.append((title, series))
        shares = sorted({k for row in self.rows for k in row if k.startswith("test/route_share/")})
        if shares:
            out.append(("provider shares of the routed decisions (test/)",
                        {k.rsplit("/", 1)[1]: self.series(k) for k in shares}))
        return out

    def rewards(self) -> list[float]:
        """The last step's per-rollout rewards, when the run logged them (a list under ``rewards``)."""
        for row in reversed(self.rows):
            values = row.get("rewards")
            if isinstance(values, list):
                return [v for v in (_number(x) for x in values) if v is not None]
        return []

    def latest(self) -> dict[str, float]:
        """The newest value of every numeric metric."""
        out: dict[str, float] = {}
        for row in [*self.rows, *([self.end] if self.end else [])]:
            out.update({k: v for k, raw in row.items() if k != "step" and (v := _number(raw)) is not None})
        return dict(sorted(out.items()))


def read_run(found: Found) -> Run:
    """Parse a run's ``metrics.jsonl`` (an unreadable line is counted, not fatal: a live run may be mid-write)."""
    config: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    end = None
    bad = 0
    with (found.path / "metrics.jsonl").open(encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh):
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(row, dict):
                bad += 1
            elif i == 0 and "config" in row:
                config = row
            elif row.get("event") == "end":
                end = row
            else:
                rows.append(row)
    run_cfg = (config.get("config") or {}).get("run") or {}
    kind = run_cfg.get("type") if isinstance(run_cfg, dict) else None
    return Run(found.id, str(kind or "sft"), config, rows, end, bad)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when it is missing or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
