"""Helpers for tests that run real fault-tolerant jobs."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from ftjax.config import load_config
from ftjax.runs.jsonl import read_jsonl
from ftjax.runtime.checkpoint import DurableCheckpoints


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a replica's metrics.jsonl."""
    steps, events = [], []
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        (events if "event" in r else steps).append(r)
    return steps, events


def committed_digests(run_dir: Path) -> dict[int, str]:
    return {r["step"]: r["param_digest"] for r in records(run_dir)[0] if r.get("committed") and "param_digest" in r}


def final_params(config_path: str, overrides: list[str], ckpt_dir: Path) -> dict:
    """The parameters of the latest durable checkpoint, as numpy arrays."""
    import jax

    from ftjax.program.step import build_program

    cfg = load_config(config_path, overrides)
    program = build_program(cfg)
    ck = DurableCheckpoints(ckpt_dir, every=1, keep=1)
    state, _ = ck.restore(program.abstract_state())
    ck.close()
    return jax.tree.map(np.asarray, state["params"])


def max_gap(step_records: list[dict]) -> tuple[float, float]:
    """(largest gap between consecutive committed steps' end times, median step time)."""
    times = [r["time"] for r in step_records if r.get("committed")]
    gaps = np.diff(times)
    return float(gaps.max()), float(statistics.median(gaps))
