"""`ftjax simulate`: the paper's preset end to end, overrides, errors, the launch preset, the sweep."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ftjax.env import limited_env
from ftjax.sim.cli import build_parser, config_from_args, main
from ftjax.sim.presets import PAPER_100K

STRATEGIES = {"sync", "ft-hsdp", "reduced-degree", "redundancy"}
QUICK = ["--steps", "300", "--seeds", "1"]


def resolve(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv))


def test_preset_json_gives_the_papers_figures_in_time():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ftjax", "simulate", "--preset", "ft-hsdp-100k", "--json"],
                          capture_output=True, text=True, timeout=120, env=limited_env())
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == STRATEGIES
    assert out["sync"]["ettr"] == pytest.approx(0.44, abs=0.03)
    assert out["ft-hsdp"]["ettr"] == pytest.approx(0.80, abs=0.03)
    assert all(0 < out[s]["ettr"] < 1 for s in STRATEGIES)
    assert elapsed < 60


def test_every_input_can_be_overridden():
    cfg = resolve(["--gpus", "49152", "--gpus-per-host", "4", "--replicas", "8", "--sync-stall-min", "12",
                   "--ft-stall-min", "2", "--replica-restart-min", "5", "--checkpoint-interval-min", "30",
                   "--checkpoint-cost-min", "1", "--seeds", "3", "--overlap", "restart"])
    assert (cfg.gpus, cfg.gpus_per_host, cfg.replicas) == (49152, 4, 8)
    assert (cfg.sync_stall_min, cfg.ft_stall_min, cfg.replica_restart_min) == (12, 2, 5)
    assert (cfg.checkpoint_interval_min, cfg.checkpoint_cost_min, cfg.seeds) == (30, 1, 3)
    assert cfg.overlap == "restart"
    # Half the GPUs of the preset: the job-level MTBF doubles, unless it is given.
    assert cfg.mtbf_min == pytest.approx(2 * PAPER_100K["mtbf_min"])
    assert resolve(["--gpus", "49152", "--mtbf-min", "25"]).mtbf_min == 25
    assert resolve([]).mtbf_min == PAPER_100K["mtbf_min"]


@pytest.mark.parametrize("argv,names", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "1000"], "--gpus"),
    (["--mtbf-min", "-1"], "--mtbf-min"),
    (["--mtbf-min", "abc"], "--mtbf-min"),
    (["--seeds", "0"], "--seeds"),
    (["--overlap", "sometimes"], "--overlap"),
    (["--redundancy", "13"], "--redundancy"),
    (["--preset", "nope"], "--preset"),
    (["--preset", "launch"], "--summary"),
    (["--summary", "x.json"], "--summary"),
    (["--no-such-option"], "--no-such-option"),
    (["--sweep", "/nonexistent-dir/x.png"], "--sweep"),
])
def test_bad_options_exit_2_naming_the_option(argv, names, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert names in captured.err
    assert captured.out == ""


def _summary(**overrides) -> dict:
    summary = {
        "median_step_s": 0.5,
        "max_healthy_stall_s": 4.0,
        "failures": 2,
        "replicas": {"0": {"catchup_s": 0.0, "restarts": 0}, "1": {"catchup_s": 3.0, "restarts": 1},
                     "2": {"catchup_s": 5.0, "restarts": 2}},
    }
    summary.update(overrides)
    return summary


def test_launch_preset_takes_the_measured_costs(tmp_path, capsys):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_summary()))
    cfg = resolve(["--preset", "launch", "--summary", str(path)])
    assert cfg.ft_stall_min == pytest.approx(4.0 / 60)       # max_healthy_stall_s
    assert cfg.replica_restart_min == pytest.approx(4.0 / 60)  # mean catch-up of restarted replicas
    assert cfg.step_s == 0.5
    assert (cfg.gpus, cfg.replicas, cfg.mtbf_min, cfg.sync_stall_min) == (98_304, 12, 18.0, 10.0)

    path.write_text(json.dumps(_summary(detection_s=1.0, quorum_s=0.25)))
    assert resolve(["--preset", "launch", "--summary", str(path)]).ft_stall_min == pytest.approx(1.75 / 60)

    # 200,000 steps of 0.5 s: about 90 failures at the preset's 18-minute MTBF.
    assert main(["--preset", "launch", "--summary", str(path), "--json", "--steps", "200000", "--seeds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Seconds of stall instead of minutes: FT-HSDP loses far less than sync.
    assert out["ft-hsdp"]["ettr"] > 0.95 > out["sync"]["ettr"]


@pytest.mark.parametrize("drop,overrides,names", [
    ("median_step_s", {}, "median_step_s"),
    ("max_healthy_stall_s", {}, "max_healthy_stall_s"),
    ("replicas", {}, "replicas"),
    ("failures", {}, "failures"),
    (None, {"failures": 0}, "failures"),
    (None, {"replicas": {"0": {"restarts": 1}}}, "catchup_s"),
    (None, {"replicas": {"0": {"catchup_s": 1.0, "restarts": 0}}}, "restarts"),
])
def test_launch_summary_errors_name_the_key(tmp_path, capsys, drop, overrides, names):
    summary = _summary(**overrides)
    summary.pop(drop, None)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert main(["--preset", "launch", "--summary", str(path)]) == 2
    assert names in capsys.readouterr().err


def test_table_output(capsys):
    assert main(QUICK) == 0
    out = capsys.readouterr().out
    for name in STRATEGIES:
        assert name in out
    assert "ETTR" in out and "breakdown" in out


def test_sweep_writes_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["--sweep", str(png), "--json", *QUICK]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = json.loads(capsys.readouterr().out)
    gpus = out["gpus"]
    assert 1_000 <= gpus[0] < 1_200 and 190_000 < gpus[-1] <= 200_000 and PAPER_100K["gpus"] in gpus
    assert set(out["ettr"]) == STRATEGIES
    for series in out["ettr"].values():
        assert len(series) == len(gpus)
    # More GPUs, more failures: every strategy ends lower than it starts.
    assert all(s[-1] < s[0] for s in out["ettr"].values())
