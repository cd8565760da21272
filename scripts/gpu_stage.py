"""The JSON of `scripts/gpu_check.sh`'s stages (issue 59): one line per stage that says why it failed,
and each stage's result from its run directory.

    gpu_stage.py NAME RC LIMIT_S SECONDS LOG     the stage's line: ok, reason, rc, seconds, result
    gpu_stage.py --mfu RUN                       the median step time, MFU and tokens/s after warm-up
    gpu_stage.py --summary JOB                   an FT job's summary: ok, digests equal, exactly once
    gpu_stage.py --field STAGES NAME a.b         one field of a stage's result (exit 1 if absent)
    gpu_stage.py --probe PROBE STAGES            raw copies against bench1b's d2h and h2d phases
    gpu_stage.py --wire JOB STAGES               the bf16 wire's FTAR phases against bench150's float32
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
from pathlib import Path

WARMUP = 2  # steps left out of the medians: the first compiles, the second may still settle


def last_json(path: Path) -> dict | None:
    """The last line of a file that is a JSON object (a stage's result), or None."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def reason(rc: int, limit: int, log: Path) -> str:
    """Why a stage ended as it did, in one line."""
    if rc == 0:
        return "ok"
    if rc in (124, 137):  # timeout's own exit, or its SIGKILL after the grace
        return f"timeout: over its {limit} s limit"
    if rc < 0:
        return "skipped: no time left in the check's T_TOTAL"
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"exit {rc}: {lines[-1] if lines else 'no output'}"[:400]


def stage_line(name: str, rc: int, limit: int, seconds: int, log: Path) -> dict:
    result = last_json(log) if rc == 0 else None
    why = reason(rc, limit, log)
    if rc == 0 and result is None:
        why = "no JSON result in its output"
    return {
        "stage": name,
        "ok": why == "ok",
        "reason": why,
        "rc": rc,
        "limit_s": limit,
        "seconds": seconds,
        "result": result,
    }


def records(run: Path) -> list[dict]:
    """Step records after warm-up of a run directory's (or a job's first replica's) metrics.jsonl."""
    files = sorted(run.rglob("metrics.jsonl"))
    if not files:
        raise SystemExit(f"no metrics.jsonl under {run}")
    recs = [json.loads(line) for line in files[0].read_text().splitlines() if '"step_time_s"' in line]
    return [r for r in recs if r.get("step", 0) > WARMUP]


def medians(recs: list[dict], keys: tuple[str, ...]) -> dict:
    out = {}
    for k in keys:
        vals = [r[k] for r in recs if r.get(k) is not None]
        out[k] = round(statistics.median(vals), 5) if vals else None
    return out


def stage_result(stages: Path, name: str) -> dict:
    for line in stages.read_text().splitlines():
        rec = json.loads(line)
        if rec["stage"] == name and rec.get("result"):
            return rec["result"]
    return {}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def probe(path: Path, stages: Path) -> dict:
    raw, phases = json.loads(path.read_text()), stage_result(stages, "bench1b").get("phases") or {}
    return {
        "raw": raw,  # copy_probe's own line: its d2h_gbps are the raw copies', not the step's
        "grad_bytes": phases.get("grad_bytes"),
        "d2h_gbps": phases.get("d2h_gbps"),
        "h2d_gbps": phases.get("h2d_gbps"),
        "d2h_vs_raw_pinned": ratio(phases.get("d2h_gbps"), raw.get("d2pinned_gbps")),
        "d2h_vs_raw_pageable": ratio(phases.get("d2h_gbps"), raw.get("d2h_gbps")),
        "h2d_vs_raw_pinned": ratio(phases.get("h2d_gbps"), raw.get("pinned2d_gbps")),
        "h2d_vs_raw_pageable": ratio(phases.get("h2d_gbps"), raw.get("h2d_gbps")),
    }


def wire(job: Path, stages: Path) -> dict:
    bf16 = medians(records(job), ("step_time_s", "ring_s", "reduce_wall_s"))
    fp32 = stage_result(stages, "bench150")
    ring32 = (fp32.get("phases") or {}).get("ring_s")
    return {
        "bf16": bf16,
        "fp32_ring_s": ring32,
        "fp32_step_s": fp32.get("ft_step_s"),
        "ring_bf16_vs_fp32": ratio(bf16["ring_s"], ring32),
    }


def summary(job: Path) -> int:
    s = json.loads((job / "summary.json").read_text())
    keys = ("ok", "digests_equal", "exactly_once", "committed_steps")
    out = {k: s.get(k) for k in keys}
    out.update(medians(records(job), ("step_time_s", "ring_s", "d2h_s", "h2d_s")))
    print(json.dumps(out))
    return 0 if s.get("ok") and s.get("digests_equal") and s.get("exactly_once") else 1


def field(stages: Path, name: str, dotted: str) -> int:
    value: object = stage_result(stages, name)
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return 1
    print(value)
    return 0


def reap(marker: str) -> None:
    """Kill what a stage left alive: processes whose command line names its scratch folder. `timeout`
    ends the stage's process group, but ftjax starts its coordinator and replicas in sessions of their
    own, and a parent killed by the limit (`ftjax bench step`) cannot stop them."""
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and int(proc.name) != me and marker in cmd:
            print(f"killed {proc.name} left by the stage: {cmd[:200]}")
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "--reap":
        reap(argv[1])
        return 0
    if mode == "--mfu":
        print(json.dumps(medians(records(Path(argv[1])), ("step_time_s", "mfu", "tokens_per_s"))))
    elif mode == "--summary":
        return summary(Path(argv[1]))
    elif mode == "--field":
        return field(Path(argv[1]), argv[2], argv[3])
    elif mode == "--probe":
        print(json.dumps(probe(Path(argv[1]), Path(argv[2]))))
    elif mode == "--wire":
        print(json.dumps(wire(Path(argv[1]), Path(argv[2]))))
    else:
        name, rc, limit, seconds, log = argv
        print(json.dumps(stage_line(name, int(rc), int(limit), int(seconds), Path(log))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
