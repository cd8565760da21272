"""Named sets of inputs for `ftjax simulate`, and the reader of an `ftjax launch` summary.

Every preset gives every input; where each number comes from is in ``SOURCES`` (printed by the
README's simulate section).

``ft-hsdp-100k`` is the job of the FT-HSDP paper (arXiv 2602.00277): 12 replicas x 8,192 GPUs,
8 GPUs per server, a job-level MTBF of 18 minutes at ~100K GPUs, a 10-minute whole-job restart per
failure for synchronous training, and for FT-HSDP a 3-minute stall of everyone then 7 minutes with
the failed replica out. The paper's 10 minutes are read as the *whole* cost of a failure to sync
training (so ``checkpoint_interval_min = 0``: no separate lost work), charged in full for every
failure (``restart_policy = overlap = "queue"``), which is the paper's own accounting:
(18 - 10) / 18 = 0.44 and (18 - 3 - 7/12) / 18 = 0.80. The step count and step time only set the
time-to-train and the length of the simulated job; they are illustrative, not from the paper.

``spare-600k`` is the setting of SPARe (arXiv 2603.00357): 600K GPUs, a job-level MTBF of 5 minutes,
a 60-minute whole-job restart, shards replicated r = 3 (the paper sweeps 3-20), checkpoints at the
optimal interval, failed groups not repaired before the next whole-job restart (the endurable-failure
count of the paper). The group count (600 of 1,000 GPUs), the checkpoint cost (1 minute) and the job
length are assumptions, not from the paper.

``launch`` is ft-hsdp-100k with the FT-HSDP costs measured by a run of `ftjax launch`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ftjax.sim.config import DEFAULT_REDUCED_CURVE, INIT_EXPONENT

# Inputs that change nothing unless set: no hardware repair, no slow replica, no pause, drawn failures.
NEUTRAL: dict[str, Any] = {
    "train_for": "tokens",
    "global_batch": "elastic",
    "step_scaling": ((1.0, 1.0),),
    "pause_fraction": 0.0,
    "failure_level": "domain",
    "failure_dist": "exponential",
    "weibull_shape": 0.7,
    "failure_trace": None,
    "blast_radius": "host",
    "hosts_per_rack": 4,
    "hardware_share": 0.0,
    "repair_min": 3 * 24 * 60.0,
    "spare_hosts": math.inf,
    "init_min": 0.0,
    "init_exponent": round(INIT_EXPONENT, 4),
    "rejoin_stall_min": 0.0,
    "reduced_recovery": "job-restart",
    "reduced_curve": DEFAULT_REDUCED_CURVE,
    "power_boost": 0.0,
    "packing": True,
    "min_degree": 0.5,
    "straggler_mtbs_min": math.inf,
    "straggler_min": 10.0,
    "straggler_slowdown": 2.0,
    "straggler_detect_min": 1.0,
    "max_slowdown": 20.0,
    # no inter-replica communication cost; DiLoCo's H and F are ftjax's defaults (ft.inner_steps, ft.fragments)
    "link_gbps": None,
    "params": None,
    "bytes_per_param": 4.0,
    "inner_steps": 20,
    "fragments": 4,
    "fragment_sync_delay": 0,
}

PAPER_100K: dict[str, Any] = {
    **NEUTRAL,
    "gpus": 98_304,
    "gpus_per_host": 8,
    "replicas": 12,
    "mtbf_min": 18.0,
    "sync_stall_min": 10.0,
    "restart_policy": "queue",
    "ft_stall_min": 3.0,
    "replica_restart_min": 7.0,
    "overlap": "queue",
    "checkpoint_interval_min": 0.0,
    "checkpoint_cost_min": 0.0,
    "redundancy": 2,
    "steps": 100_000,
    "step_s": 10.0,
    "seeds": 8,
    "seed": 0,
}

# The paper's effective-training-time figures for its job, drawn on the sweep plot as references.
PAPER_100K_ETTR = {"sync": 0.44, "ft-hsdp": 0.80}

SPARE_600K: dict[str, Any] = {
    **NEUTRAL,
    "gpus": 600_000,
    "gpus_per_host": 8,
    "replicas": 600,
    "mtbf_min": 5.0,
    "sync_stall_min": 60.0,
    "restart_policy": "absorb",
    "ft_stall_min": 0.0,
    "replica_restart_min": math.inf,
    "overlap": "queue",
    "checkpoint_interval_min": "optimal",
    "checkpoint_cost_min": 1.0,
    "redundancy": 3,
    "steps": 10_000,
    "step_s": 6.0,
    "seeds": 4,
    "seed": 0,
    "max_slowdown": 100.0,
}

PRESETS: dict[str, dict[str, Any]] = {"ft-hsdp-100k": PAPER_100K, "spare-600k": SPARE_600K, "launch": PAPER_100K}

# The strategies a preset runs unless --strategies says otherwise.
PRESET_STRATEGIES: dict[str, tuple[str, ...]] = {
    "ft-hsdp-100k": ("sync", "ft-hsdp", "reduced-degree", "replication", "spare"),
    "spare-600k": ("sync", "replication", "spare"),
    "launch": ("sync", "ft-hsdp", "reduced-degree", "replication", "spare"),
}

# Where each preset's numbers come from (the README prints these).
SOURCES: dict[str, dict[str, str]] = {
    "ft-hsdp-100k": {
        "gpus, replicas, gpus_per_host": "FT-HSDP paper (arXiv 2602.00277): 98,304 = 12 x 8,192, 8 per server",
        "mtbf_min": "FT-HSDP paper: 18 min at ~100K GPUs (2.3 interruptions / 1,000 servers / day at 32K)",
        "sync_stall_min": "FT-HSDP paper: 10 min per failure, lost work included (checkpoint_interval_min 0)",
        "ft_stall_min, replica_restart_min": "FT-HSDP paper: 3 min stall, 7 min out; measured by ftjax in "
        "--preset launch / --from-run",
        "restart_policy, overlap": "queue: the paper charges every failure its full cost",
        "steps, step_s": "illustrative (set the time to train only)",
        "reduced_*": (
            "NTP (arXiv 2504.06095): job restart per failure, packing; the curve measured by `ftjax bench reduced`"
        ),
        "redundancy": "SPARe (arXiv 2603.00357): r = 2",
    },
    "spare-600k": {
        "gpus, mtbf_min, sync_stall_min": "SPARe (arXiv 2603.00357): 600K GPUs, MTBF 5 min, 60 min restart",
        "redundancy": "SPARe: r = 3 (the paper sweeps 3-20)",
        "replica_restart_min": "SPARe's endurable-failure count: no repair before the next whole-job restart",
        "checkpoint_interval_min": "SPARe optimises it jointly with r: here the availability optimum",
        "replicas, checkpoint_cost_min, steps, step_s": "assumed: 600 groups of 1,000 GPUs, 1 min per save",
        "restart_policy": "absorb (the README gives queue and restart too)",
    },
}


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
    - ``replica_restart_min``: the mean ``recovery_s`` of the summary's ``failure_events`` (a
      replica's death to its rejoin: restart, start-up and catch-up), else the mean ``catchup_s`` of
      the replicas that restarted (``restarts > 0``).
    The step time stays the preset's (the 100K job's 10 s): a small model's step on this machine
    says nothing of it, and with it the job would train in no time.
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
        raise PresetError(
            f"{where}: 'failures' is {failures!r}: the run injected no failure, so it measured no failure stall"
        )
    if "detection_s" in data and "quorum_s" in data:
        stall_s = _number(data, "detection_s", where) + _number(data, "quorum_s", where) + step_s
    else:
        stall_s = _number(data, "max_healthy_stall_s", where)

    return {"ft_stall_min": stall_s / 60.0, "replica_restart_min": _restart_s(data, where) / 60.0}


def _restart_s(data: dict, where: str) -> float:
    """A replica's restart in a launch summary: the mean death-to-rejoin of its failure events, else
    the mean catch-up of the replicas that restarted."""
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
    events = data.get("failure_events")
    recoveries = [
        e["recovery_s"]
        for e in (events if isinstance(events, list) else [])
        if isinstance(e, dict) and isinstance(e.get("recovery_s"), (int, float)) and e.get("replica") is not None
    ]
    return sum(recoveries) / len(recoveries) if recoveries else sum(catchups) / len(catchups)


def preset_inputs(name: str, overrides: dict[str, Any], summary: str | None = None) -> dict[str, Any]:
    """The inputs of preset ``name`` with ``overrides`` applied (not yet validated).

    When ``gpus`` is overridden, the job-level MTBF scales inversely with the GPU count (the rate per
    failure domain is what stays fixed) and communicator init as GPUs^init_exponent, unless they are
    overridden too.
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
    if isinstance(gpus, int) and gpus > 0 and not isinstance(gpus, bool):
        scale = gpus / inputs["gpus"]
        if "mtbf_min" not in overrides:
            inputs["mtbf_min"] = inputs["mtbf_min"] / scale
        if "init_min" not in overrides:
            inputs["init_min"] = inputs["init_min"] * scale ** overrides.get("init_exponent", inputs["init_exponent"])
    inputs.update(overrides)
    return inputs
