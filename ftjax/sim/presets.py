"""Named sets of inputs for `ftjax simulate`, and the reader of an `ftjax launch` summary.

``ft-hsdp-100k`` is the job of the FT-HSDP paper (arXiv 2602.00277): 12 replicas x 8,192 GPUs,
8 GPUs per server, a job-level MTBF of 18 minutes at ~100K GPUs, a 10-minute whole-job restart per
failure for synchronous training, and for FT-HSDP a 3-minute stall of everyone then 7 minutes with
the failed replica out. The paper's 10 minutes are read as the *whole* cost of a failure to sync
training (so ``checkpoint_interval_min = 0``: no separate lost work), charged in full for every
failure (``overlap = "queue"``), which is the paper's own accounting: (18 - 10) / 18 = 0.44 and
(18 - 3 - 7/12) / 18 = 0.80. The step count and step time only set the time-to-train and the
length of the simulated job; they are illustrative, not from the paper.

``launch`` is the same job with the FT-HSDP costs measured by a run of `ftjax launch`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PAPER_100K: dict[str, Any] = {
    "gpus": 98_304,
    "gpus_per_host": 8,
    "replicas": 12,
    "mtbf_min": 18.0,
    "failure_dist": "exponential",
    "weibull_shape": 0.7,
    "sync_stall_min": 10.0,
    "ft_stall_min": 3.0,
    "replica_restart_min": 7.0,
    "rejoin_stall_min": 0.0,
    "checkpoint_interval_min": 0.0,
    "checkpoint_cost_min": 0.0,
    "redundancy": 2,
    "overlap": "queue",
    "steps": 100_000,
    "step_s": 10.0,
    "seeds": 8,
    "seed": 0,
}

# The paper's effective-training-time figures for its job, drawn on the sweep plot as references.
PAPER_100K_ETTR = {"sync": 0.44, "ft-hsdp": 0.80}

PRESETS: dict[str, dict[str, Any]] = {"ft-hsdp-100k": PAPER_100K, "launch": PAPER_100K}


class PresetError(ValueError):
    """A preset's inputs could not be read (e.g. a key missing from a launch summary)."""


def _number(data: dict, key: str, where: str) -> float:
    if key not in data:
        raise PresetError(f"{where}: missing key {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PresetError(f"{where}: {key!r} must be a non-negative number, got {value!r}")
    return float(value)


def launch_inputs(summary_path: str | Path) -> dict[str, Any]:
    """The FT-HSDP costs measured by `ftjax launch`, read from its ``summary.json``.

    - ``ft_stall_min``: detection + quorum + one retried step (``detection_s + quorum_s +
      median_step_s``) when the summary has ``detection_s`` and ``quorum_s``, else the longest stall
      of a healthy replica around a failure (``max_healthy_stall_s``), which contains all three.
    - ``replica_restart_min``: mean ``catchup_s`` of the replicas that restarted (``restarts > 0``).
    - ``step_s``: ``median_step_s``.
    ``failures`` must be at least 1 (a count, or a list of failure records): without a failure the
    stall measures nothing. These are costs on one machine with a small model: a lower bound for a
    cluster, where detection timeouts, allocation and state transfer are longer.
    """
    path = Path(summary_path)
    where = str(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise PresetError(f"--summary: cannot read {where}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise PresetError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise PresetError(f"{where}: expected a JSON object")

    step_s = _number(data, "median_step_s", where)
    if step_s == 0:
        raise PresetError(f"{where}: 'median_step_s' must be positive")
    if "failures" not in data:
        raise PresetError(f"{where}: missing key 'failures'")
    failures = data["failures"]
    n_failures = len(failures) if isinstance(failures, list) else failures
    if isinstance(n_failures, bool) or not isinstance(n_failures, int) or n_failures < 1:
        raise PresetError(f"{where}: 'failures' is {failures!r}: the run injected no failure, so it "
                          "measured no failure stall")
    if "detection_s" in data and "quorum_s" in data:
        stall_s = _number(data, "detection_s", where) + _number(data, "quorum_s", where) + step_s
    else:
        stall_s = _number(data, "max_healthy_stall_s", where)

    replicas = data.get("replicas")
    if not isinstance(replicas, dict):
        raise PresetError(f"{where}: missing key 'replicas' (an object: replica id -> record)")
    catchups = []
    for rid, rec in replicas.items():
        rwhere = f"{where}: replicas[{rid!r}]"
        if not isinstance(rec, dict):
            raise PresetError(f"{rwhere}: expected an object")
        if _number(rec, "restarts", rwhere) > 0:
            catchups.append(_number(rec, "catchup_s", rwhere))
    if not catchups:
        raise PresetError(f"{where}: no replica has 'restarts' > 0, so no 'catchup_s' was measured")

    return {
        "ft_stall_min": stall_s / 60.0,
        "replica_restart_min": sum(catchups) / len(catchups) / 60.0,
        "step_s": step_s,
    }


def preset_inputs(name: str, overrides: dict[str, Any], summary: str | None = None) -> dict[str, Any]:
    """The inputs of preset ``name`` with ``overrides`` applied (not yet validated).

    When ``gpus`` is overridden and ``mtbf_min`` is not, the job-level MTBF scales inversely with the
    GPU count (the per-host failure rate is what stays fixed).
    """
    if name not in PRESETS:
        raise PresetError(f"--preset: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    inputs = dict(PRESETS[name])
    if name == "launch":
        if summary is None:
            raise PresetError("--preset launch needs --summary RUN/summary.json (from `ftjax launch`)")
        inputs.update(launch_inputs(summary))
    elif summary is not None:
        raise PresetError(f"--summary is only read by --preset launch, not --preset {name}")
    gpus = overrides.get("gpus")
    if "mtbf_min" not in overrides and isinstance(gpus, int) and gpus > 0:
        inputs["mtbf_min"] = inputs["mtbf_min"] * inputs["gpus"] / gpus
    inputs.update(overrides)
    return inputs
