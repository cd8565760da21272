"""The sweep plot: effective training time against GPU count, one line per strategy."""

from __future__ import annotations

import textwrap
from pathlib import Path

# Figure without pyplot renders with the Agg backend and keeps no global figure state.
from matplotlib.figure import Figure

_STYLE = {"sync": "o-", "ft-hsdp": "s-", "reduced-degree": "^-", "redundancy": "d-"}


def write_sweep(path: str | Path, gpu_counts: list[int], series: dict[str, list[float]], *, title: str,
                reference: dict[str, float] | None = None, reference_gpus: int | None = None) -> None:
    """Write a PNG of ETTR vs GPU count (log x axis); ``reference`` marks published figures at
    ``reference_gpus``."""
    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.add_subplot()
    for name, values in series.items():
        ax.plot(gpu_counts, values, _STYLE.get(name, "-"), label=name, markersize=4)
    if reference and reference_gpus:
        for name, value in reference.items():
            ax.plot([reference_gpus], [value], "k*", markersize=11)
            ax.annotate(f"paper {name} {value:.2f}", (reference_gpus, value), textcoords="offset points",
                        xytext=(-8, 8), ha="right", fontsize=8)
        ax.axvline(reference_gpus, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("GPUs (job-level MTBF scales as 1 / GPUs)")
    ax.set_ylabel("effective training time (productive / total GPU-time)")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, format="png")
