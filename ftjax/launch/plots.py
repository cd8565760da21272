"""The run's two pictures: `RUN/loss.png` (loss per step per replica, failures and rejoins marked)
and `RUN/timeline.png` (each replica's state over time)."""

from __future__ import annotations

from pathlib import Path

# Figure without pyplot renders with the Agg backend and keeps no global figure state.
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ftjax.runs.lifecycle import PHASE_COLORS, Phase
from ftjax.runs.summary import Run, timeline

# One colour per lifecycle phase (ftjax/runs/lifecycle.py), keyed by the names summary.json uses.
_COLORS = PHASE_COLORS
assert set(_COLORS) == {p.value for p in Phase}, "a lifecycle phase without a colour"


def write_loss(run: Run, path: str | Path) -> None:
    """Loss of each replica's own steps; a replica's death (x at the step it reached) and its rejoin
    (triangle at the step its installed state reached) in the replica's colour; coordinator kills as
    grey lines."""
    fig = Figure(figsize=(9, 4.8), dpi=110)
    ax = fig.add_subplot()
    for r in range(run.replicas):
        color = f"C{r % 10}"
        by_step: dict[int, float] = {}
        for i, inc in enumerate(run.incarnations(r)):  # one line per incarnation: no line across a death
            own = [
                m
                for m in inc.records
                if "step" in m
                and "event" not in m
                and m.get("committed")
                and not m.get("healing")
                and m.get("loss") is not None
            ]
            ax.plot(
                [m["step"] for m in own],
                [m["loss"] for m in own],
                lw=0.9,
                alpha=0.85,
                color=color,
                label=f"replica {r}" if i == 0 else None,
            )
            by_step.update((m["step"], m["loss"]) for m in own)
        down_at = None
        for e in run.events:
            if e.get("replica") != r:
                continue
            if e["event"] == "replica_down":
                down_at = e["step"]
                ax.plot([e["step"]], [_near(by_step, e["step"])], "x", color=color, ms=11, mew=2.5)
            elif e["event"] == "rejoined" and e.get("at_step") is not None:
                ax.plot([e["at_step"]], [_near(by_step, e["at_step"])], "^", color=color, ms=9, mec="black")
                if down_at is not None:  # the steps the job trained without this replica
                    ax.axvspan(down_at, e["at_step"], color=color, alpha=0.12, lw=0)
                    down_at = None
        if down_at is not None:
            ax.axvspan(down_at, run.steps, color=color, alpha=0.12, lw=0)
    for e in run.events:
        if e["event"] == "fault" and e.get("kind") == "kill_coordinator":
            ax.axvline(e.get("step") or 0, color="grey", lw=1.2, alpha=0.8)
    ax.plot([], [], "kx", ms=9, mew=2, label="replica died")
    ax.plot([], [], "k^", ms=8, label="rejoined (caught up); shaded: replica away")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (own batch)")
    ax.set_title(f"{Path(str(run.launch.get('config'))).name}: {run.replicas} replicas, {run.steps} steps", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _near(by_step: dict[int, float], step: int) -> float:
    """The loss at the step closest to `step` (a marker needs a height)."""
    if not by_step:
        return 0.0
    return by_step[min(by_step, key=lambda s: abs(s - step))]


def write_timeline(run: Run, path: str | Path, median_s: float) -> None:
    """One row per replica: coloured spans of its states, seconds since launch."""
    segments = timeline(run, median_s)
    fig = Figure(figsize=(9, 1.6 + 0.6 * run.replicas), dpi=110)
    ax = fig.add_subplot()
    for r, segs in segments.items():
        for state in _COLORS:
            spans = [(a - run.start, b - a) for a, b, s in segs if s == state]
            if spans:
                ax.broken_barh(spans, (r - 0.35, 0.7), facecolors=_COLORS[state])
    for e in run.events:
        if e["event"] == "replica_down":
            ax.plot([e["time"] - run.start], [e["replica"]], "kx", ms=9, mew=2)
        elif e["event"] == "coordinator_down":
            ax.axvline(e["time"] - run.start, color="black", lw=1, ls=":")
    ax.set_yticks(range(run.replicas), [f"replica {r}" for r in range(run.replicas)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since launch")
    ax.set_title("replica states (x: death; dotted: coordinator down)", fontsize=10)
    fig.legend(
        handles=[Patch(color=c, label=s) for s, c in _COLORS.items()],
        loc="lower center",
        ncol=6,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, format="png")
