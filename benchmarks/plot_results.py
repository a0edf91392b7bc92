"""Charts of the committed benchmark results: ``benchmarks/results/<name>-<card>.png``.

    python benchmarks/plot_results.py                 # every *-<card>.json under benchmarks/results
    python benchmarks/plot_results.py --smoke DIR     # the same for the JSON files in DIR (tests)

Each chart puts gpufeed beside the baselines and the ceiling of the same run, as the tables do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _bars(ax, labels: list[str], values: list[float], colors: list[str], unit: str) -> None:
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)


def _color(method: str) -> str:
    if "ceiling" in method or method in ("ideal", "pinned_h2d"):
        return "#999999"
    return "#2e7d32" if method.startswith("gpufeed") else "#c62828"


def plot_prefetcher(d: dict, ax_list) -> None:
    workloads = ("unpinned", "pinned", "unpinned_compute", "unpinned_compute_sync")
    for ax, workload in zip(ax_list, workloads, strict=True):
        rows = [r for r in d["rows"] if r.get("workload") in (workload, "ceiling") and r.get("GBps")]
        rows = [r for r in rows if r["workload"] == workload or r["method"] == "pinned_h2d"]
        if len(rows) < 2:  # a result file from before this workload existed
            ax.set_visible(False)
            continue
        _bars(ax, [r["method"] for r in rows], [r["GBps"] for r in rows],
              [_color(r["method"]) for r in rows], "GB/s")
        ax.set_title(workload, fontsize=9)


def plot_sources(d: dict, ax_list) -> None:
    for ax, cache in zip(ax_list, ("warm", "cold"), strict=True):
        rows = [r for r in d["rows"] if r.get("cache") == cache and r.get("GBps")
                and not r["method"].endswith("_read16") and r.get("workload") != "compute"]
        _bars(ax, [f"{r['workload']}: {r['method']}" for r in rows], [r["GBps"] for r in rows],
              [_color(r["method"]) for r in rows], "GB/s")
        ax.set_title(f"{cache} page cache", fontsize=9)


def plot_tabpfn(d: dict, ax_list) -> None:
    rows = [r for r in d["rows"] if r.get("over_ideal")]
    _bars(ax_list[0], [r["method"] for r in rows], [r["over_ideal"] for r in rows],
          [_color(r["method"]) for r in rows], "time / ideal (1.0 = data already in VRAM)")
    ax_list[0].axvline(1.05, color="k", lw=0.8, ls="--")


PLOTS = {"prefetcher": (plot_prefetcher, 4), "sources": (plot_sources, 2), "tabpfn": (plot_tabpfn, 1)}


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", metavar="DIR", help="plot the JSON files of DIR instead of benchmarks/results")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = Path(args.smoke) if args.smoke else RESULTS
    written = []
    for path in sorted(where.glob("*.json")):
        name = path.stem.split("-", 1)[0]
        if name not in PLOTS:
            continue
        plot, n = PLOTS[name]
        d = json.loads(path.read_text())
        fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
        plot(d, list(axes[0]))
        fig.suptitle(f"gpufeed {name} benchmark on {d.get('card', path.stem.split('-', 1)[-1])}", fontsize=10)
        fig.tight_layout()
        out = path.with_suffix(".png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
        print(f"wrote {out}")
    return written


if __name__ == "__main__":
    main()
