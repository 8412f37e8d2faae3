"""Plot ``bench/gateway_overhead.py`` results: where each row's CPU went, and its throughput.

    python bench/plot_gateway_overhead.py bench/results/gateway_overhead_before.json \\
        bench/results/gateway_overhead_c100_max50ms.json --out docs/gateway-overhead.png

One panel per results file (titled by its file name): per row, a stacked bar of CPU milliseconds per
request in each process (providers, the proxy or gateway, the load generator), with req/s and spooled
traces written above it. The two cores are shared, so CPU per request is what bounds throughput.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROCESSES = (("providers", "#9aa5b1"), ("gateway", "#d9822b"), ("driver", "#5c7cfa"))
SHORT = {"plain asyncio fan-out": "in-process\nfan-out", "plain Python proxy": "plain Python\nproxy",
         "fanroute gateway (in-memory bus)": "gateway\n(in-memory)", "fanroute gateway (Kafka, acks=all)":
         "gateway\n(Kafka acks=all)"}


def short(name: str) -> str:
    """A row's tick label: the known names, else ``gateway`` and the row's qualifiers one per line."""
    if name in SHORT:
        return SHORT[name]
    if name.startswith("fanroute gateway (") and name.endswith(")"):
        return "gateway\n" + name[len("fanroute gateway ("):-1].replace(", ", "\n")
    return name


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(p, json.loads(p.read_text())) for p in paths]
    top = max(sum(r["cpu_ms_per_request"].values()) for _, d in runs for r in d["results"].values())
    fig, axes = plt.subplots(1, len(runs), figsize=(max(5.2, 0.9 * max(len(d['results']) for _, d in runs)) * len(runs), 4.6), sharey=True, squeeze=False)
    for ax, (path, data) in zip(axes[0], runs):
        names = list(data["results"])
        bottom = [0.0] * len(names)
        for proc, colour in PROCESSES:
            ms = [data["results"][n]["cpu_ms_per_request"].get(proc, 0.0) for n in names]
            ax.bar(range(len(names)), ms, bottom=bottom, color=colour, label=proc)
            bottom = [b + m for b, m in zip(bottom, ms)]
        for i, n in enumerate(names):
            row = data["results"][n]
            note = f"{row['throughput_rps']:.0f} req/s" + (f"\n{row['spooled']} spooled" if row.get("spooled") else "")
            ax.text(i, bottom[i] + top * 0.02, note, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [short(n) for n in names], fontsize=8)
        at = f" @ {data['commit']}" if data.get("commit") else ""
        ax.set_title(f"{path.stem}{at}\n{data['requests']} requests, {data['concurrency']} concurrent, "
                     f"{data.get('snippet_chars', 16)}-char snippets", fontsize=9)
        ax.set_ylim(0, top * 1.3)
    axes[0][0].set_ylabel("CPU ms per request (2 shared cores)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="JSON files written by bench/gateway_overhead.py")
    p.add_argument("--out", type=Path, default=Path("docs/gateway-overhead.png"))
    args = p.parse_args()
    plot(args.results, args.out)


if __name__ == "__main__":
    main()
