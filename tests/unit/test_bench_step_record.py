"""`ftjax bench step`'s record from its runs' metrics, with the runs faked: which runs it starts
(`--no-serial` skips the serial path's) and the gradient path's GB/s from the bytes each step moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftjax_bench import step as bench_step

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _write_run(run: Path, step_s: float, d2h_s: float, h2d_s: float, grad_bytes: int) -> Path:
    """A replica's run directory: 4 steps of metrics.jsonl (the per-step checksum and the phases)
    and the summary's sha256 time."""
    run.mkdir(parents=True)
    recs = [
        {
            "step": s,
            "step_time_s": step_s * s,  # (distinct: after 1 warm-up step, the median is step 3's)
            "digest_s": 0.01,
            "d2h_s": d2h_s,
            "ring_s": 0.5,
            "h2d_s": h2d_s,
            "reduce_wall_s": 0.6,
            "overlap_share": 0.2,
            "grad_bytes": grad_bytes,
        }
        for s in range(1, 5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps({"param_digest_s": 0.2}))
    return run


@pytest.mark.parametrize("serial", [True, False])
def test_the_record_names_each_paths_gbps_and_skips_the_serial_run_when_asked(monkeypatch, tmp_path, capsys, serial):
    started = []

    def run_ft(config, overrides, out, timeout, cpus):
        started.append(out.name)
        d2h = 0.25 if "ft.grad_path=serial" not in overrides else 1.0
        return _write_run(out / "replica-0", 1.0, d2h_s=d2h, h2d_s=0.5, grad_bytes=2_000_000_000), [[0], [1]]

    def run_standalone(config, overrides, devices, out, timeout, cpus):
        return _write_run(out / "standalone-0", 0.9, 0, 0, 0) / "metrics.jsonl"

    monkeypatch.setattr(bench_step, "run_ft", run_ft)
    monkeypatch.setattr(bench_step, "run_standalone", run_standalone)
    args = [TINY, "--steps", "4", "--warmup", "1", "--no-sync", "--out", str(tmp_path)]
    assert bench_step.main(args + ([] if serial else ["--no-serial"])) == 0
    record = json.loads(capsys.readouterr().out)
    assert started == (["ft", "ft-serial"] if serial else ["ft"])
    phases = record["phases"]
    assert phases["grad_bytes"] == 2_000_000_000
    assert phases["d2h_gbps"] == 8.0 and phases["h2d_gbps"] == 4.0  # 2 GB in 0.25 s and in 0.5 s
    assert record["ft_vs_standalone"] == round(3.0 / 2.7, 4)  # medians of steps 2-4
    if serial:
        assert record["serial_phases"]["d2h_gbps"] == 2.0 and record["serial_vs_standalone"] == round(3.0 / 2.7, 4)
    else:
        assert record["serial_phases"] is None and record["ft_serial_step_s"] is None
        assert record["serial_vs_standalone"] is None


def test_a_step_that_relayed_zeros_is_not_counted_in_the_gbps(tmp_path):
    # a healing replica moves nothing device -> host: its steps (grad_bytes 0) leave the medians alone
    run = _write_run(tmp_path / "r", 1.0, d2h_s=0.5, h2d_s=0.5, grad_bytes=1_000_000_000)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs[1:3]:  # steps 2 and 3 of the 3 after warm-up
        r.update(d2h_s=0.0, h2d_s=0.0, grad_bytes=0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    phases = bench_step._phases(run / "metrics.jsonl", 1)
    assert phases["d2h_gbps"] == 2.0 and phases["h2d_gbps"] == 2.0
