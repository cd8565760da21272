"""The sweep plot: ETTR and time-to-train ratio against one input, one line per strategy."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

# Figure without pyplot renders with the Agg backend and keeps no global figure state.
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter

_STYLE = {
    "sync": "o-",
    "ft-hsdp": "s-",
    "reduced-degree": "^-",
    "replication": "d-",
    "spare": "v-",
    "diloco": "P-",
    "streaming-diloco": "X-",
}


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def write_sweep(
    path: str | Path,
    knob: str,
    values: list[Any],
    series: dict[str, dict[str, list[float | None]]],
    *,
    title: str,
    reference: dict[str, float] | None = None,
    reference_at: float | None = None,
) -> None:
    """Write a PNG of ETTR (left) and time-to-train ratio (right, log) vs ``knob``; ``reference``
    marks published ETTR figures at ``reference_at``."""
    fig = Figure(figsize=(12, 5), dpi=110)
    ettr_ax, ttt_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    numeric = _numeric(values)
    xs = values if numeric else list(range(len(values)))
    for name, ys in series["ettr"].items():
        ettr_ax.plot(xs, [math.nan if v is None else v for v in ys], _STYLE.get(name, "-"), label=name, markersize=4)
        ratios = [math.nan if v is None else v for v in series["ttt_ratio"][name]]
        ttt_ax.plot(xs, ratios, _STYLE.get(name, "-"), label=name, markersize=4)
    if reference and reference_at:
        for name, value in reference.items():
            ettr_ax.plot([reference_at], [value], "k*", markersize=11)
            ettr_ax.annotate(
                f"paper {name} {value:.2f}",
                (reference_at, value),
                textcoords="offset points",
                xytext=(-8, 8),
                ha="right",
                fontsize=8,
            )
        ettr_ax.axvline(reference_at, color="grey", linestyle=":", linewidth=1)
    log_x = numeric and min(values) > 0 and max(values) / min(values) >= 10
    for ax in (ettr_ax, ttt_ax):
        if log_x:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(FormatStrFormatter(""))
        if not numeric:
            ax.set_xticks(xs, [str(v) for v in values])
        ax.set_xlabel(knob + (" (job-level MTBF scales as 1 / GPUs)" if knob == "gpus" else ""))
        ax.grid(True, which="both", alpha=0.3)
    ettr_ax.set_ylim(0, 1)
    ettr_ax.set_ylabel("effective training time (productive / total GPU-time)")
    ttt_ax.set_yscale("log")
    ttt_ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ttt_ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ttt_ax.set_ylabel("time to train / failure-free time (missing: not finished)")
    ettr_ax.legend(loc="best", fontsize=8)
    fig.suptitle(textwrap.fill(title, 140), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
