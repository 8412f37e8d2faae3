"""Charts as inline SVG, drawn by matplotlib on the server (no chart code of our own, no script needed).

Each series is an SVG group ``id="series-<name>"`` holding its line and one marker per data point, so a
browser test (or a person with the inspector) can find what was drawn.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Mapping, Sequence

_LOCK = threading.Lock()  # pyplot's state is global: one figure at a time


def _pyplot():  # noqa: ANN202 - matplotlib is imported on first use, with the file backend
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig) -> str:  # noqa: ANN001
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: the SVG goes inline in a page


def _gid(name: str) -> str:
    return "series-" + re.sub(r"[^A-Za-z0-9_-]", "_", name)


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, x_label: str = "step",
               y_label: str = "") -> str:
    """One panel, a line with point markers per series: ``name → [(x, y), ...]``."""
    plt = _pyplot()
    with _LOCK:
        fig, ax = plt.subplots(figsize=(5.2, 2.8), dpi=96)
        try:
            for name, points in series.items():
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                (line,) = ax.plot(xs, ys, marker="o", ms=2.5, lw=1.2, label=name)
                line.set_gid(_gid(name))
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(x_label, fontsize=8)
            if y_label:
                ax.set_ylabel(y_label, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if len(series) > 1:
                ax.legend(fontsize=7, loc="best")
            return _svg(fig)
        finally:
            plt.close(fig)


def histogram(title: str, values: Sequence[float], *, bins: int = 20, x_label: str = "") -> str:
    """A histogram of ``values`` (one series, ``series-<title>``)."""
    plt = _pyplot()
    with _LOCK:
        fig, ax = plt.subplots(figsize=(5.2, 2.8), dpi=96)
        try:
            _, _, patches = ax.hist(values, bins=bins, color="C2", alpha=0.8)
            for p in patches:
                p.set_gid(_gid(title))
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(x_label, fontsize=8)
            ax.tick_params(labelsize=7)
            return _svg(fig)
        finally:
            plt.close(fig)


def cost_quality(title: str, points: Mapping[str, tuple[float, float]],
                 curve: Sequence[tuple[float, float]] = (), hull: Sequence[tuple[float, float]] = ()) -> str:
    """The cost–quality plane: labelled policies, the router's frontier and the providers' mixing hull."""
    plt = _pyplot()
    with _LOCK:
        fig, ax = plt.subplots(figsize=(6.0, 3.6), dpi=96)
        try:
            if curve:
                (line,) = ax.plot(*zip(*curve, strict=True), "o-", c="C3", ms=3, label="router frontier")
                line.set_gid(_gid("router frontier"))
            if hull:
                (line,) = ax.plot(*zip(*hull, strict=True), "--", c="0.5", lw=1, label="mixing hull")
                line.set_gid(_gid("mixing hull"))
            for name, (cost, quality) in points.items():
                (dot,) = ax.plot([cost], [quality], "s" if name in ("candidate", "deployed") else "o", ms=5)
                dot.set_gid(_gid(name))
                ax.annotate(name, (cost, quality), xytext=(4, 3), textcoords="offset points", fontsize=7)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("cost per query (USD)", fontsize=8)
            ax.set_ylabel("quality", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
            return _svg(fig)
        finally:
            plt.close(fig)
