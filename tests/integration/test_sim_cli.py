"""`ftjax simulate`: the paper's preset end to end, overrides, errors, the launch preset, the sweep."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftjax.base.env import limited_env
from ftjax.sim.cli import build_parser, config_from_args, main
from ftjax.sim.presets import PAPER_100K

STRATEGIES = {"sync", "ft-hsdp", "reduced-degree", "replication", "spare"}
RECORDED = str(Path(__file__).parents[1] / "data" / "launch_kill_restart")
QUICK = ["--steps", "300", "--seeds", "1"]


def resolve(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv))


def test_preset_json_gives_the_papers_figures_in_time():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ftjax", "simulate", "--preset", "ft-hsdp-100k", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=limited_env(),
    )
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
    cfg = resolve(
        [
            "--gpus",
            "49152",
            "--gpus-per-host",
            "4",
            "--replicas",
            "8",
            "--sync-stall-min",
            "12",
            "--ft-stall-min",
            "2",
            "--replica-restart-min",
            "5",
            "--checkpoint-interval-min",
            "30",
            "--checkpoint-cost-min",
            "1",
            "--seeds",
            "3",
            "--overlap",
            "restart",
            "--restart-policy",
            "absorb",
            "--hardware-share",
            "0.5",
            "--repair-min",
            "600",
            "--spare-hosts",
            "inf",
            "--blast-radius",
            "rack",
            "--hosts-per-rack",
            "4",
            "--failure-level",
            "job",
            "--reduced-curve",
            "0:0,0.5:0.5,1:1",
            "--packing",
            "false",
            "--power-boost",
            "0.2",
            "--straggler-mtbs-min",
            "60",
            "--train-for",
            "steps",
            "--step-scaling",
            "0.5:0.8,1:1",
        ]
    )
    assert (cfg.gpus, cfg.gpus_per_host, cfg.replicas) == (49152, 4, 8)
    assert (cfg.sync_stall_min, cfg.ft_stall_min, cfg.replica_restart_min) == (12, 2, 5)
    assert (cfg.checkpoint_interval_min, cfg.checkpoint_cost_min, cfg.seeds) == (30, 1, 3)
    assert (cfg.overlap, cfg.restart_policy, cfg.blast_radius, cfg.failure_level) == (
        "restart",
        "absorb",
        "rack",
        "job",
    )
    assert (cfg.hardware_share, cfg.repair_min, cfg.spare_hosts) == (0.5, 600, float("inf"))
    assert cfg.reduced_curve == ((0, 0), (0.5, 0.5), (1, 1)) and cfg.packing is False and cfg.power_boost == 0.2
    assert cfg.step_scaling == ((0.5, 0.8), (1, 1)) and cfg.train_for == "steps"
    assert (
        resolve(["--checkpoint-interval-min", "daly", "--checkpoint-cost-min", "1"]).checkpoint_interval_min == "daly"
    )
    # Half the GPUs of the preset: the job-level MTBF doubles, unless it is given.
    assert cfg.mtbf_min == pytest.approx(2 * PAPER_100K["mtbf_min"])
    assert resolve(["--gpus", "49152", "--mtbf-min", "25"]).mtbf_min == 25
    assert resolve([]).mtbf_min == PAPER_100K["mtbf_min"]


@pytest.mark.parametrize(
    "argv,names",
    [
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
        (["--checkpoint-interval-min", "young"], "--checkpoint-interval-min"),  # needs a save cost
        (["--checkpoint-interval-min", "sometimes"], "--checkpoint-interval-min"),
        (["--reduced-curve", "0:0,1"], "--reduced-curve"),
        (["--reduced-curve", "0.5:0.4,1:1"], "--reduced-curve"),
        (["--step-scaling", "0:1"], "--step-scaling"),
        (["--hardware-share", "2"], "--hardware-share"),
        (["--spare-hosts", "1.5"], "--spare-hosts"),
        (["--packing", "maybe"], "--packing"),
        (["--blast-radius", "rack", "--hosts-per-rack", "5"], "--hosts-per-rack"),
        (["--failure-trace", "/nonexistent/trace.csv", *QUICK], "--failure-trace"),
        (["--strategies", "sync,nope"], "--strategies"),
        (["--sweep", "x.png", "--sweep-over", "nope"], "--sweep-over"),
        (["--sweep", "x.png", "--sweep-over", "mtbf_min", "--sweep-values", "5,abc"], "--sweep-values"),
        (["--sweep", "x.png", "--sweep-over", "mtbf_min", "--sweep-values", "5,-1"], "--sweep-values"),
        (["--from-run", "/nonexistent-run"], "--from-run"),
        (["--costs-from", RECORDED], "--costs-from"),
    ],
)
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
        "replicas": {
            "0": {"catchup_s": 0.0, "restarts": 0},
            "1": {"catchup_s": 3.0, "restarts": 1},
            "2": {"catchup_s": 5.0, "restarts": 2},
        },
    }
    summary.update(overrides)
    return summary


def test_launch_preset_takes_the_measured_costs(tmp_path, capsys):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_summary()))
    cfg = resolve(["--preset", "launch", "--summary", str(path)])
    assert cfg.ft_stall_min == pytest.approx(4.0 / 60)  # max_healthy_stall_s
    assert cfg.replica_restart_min == pytest.approx(4.0 / 60)  # mean catch-up of restarted replicas
    assert cfg.step_s == 10.0  # the 100K job's, not the small run's
    # with its failure events: a replica's death to its rejoin (restart and start-up included)
    events = [{"replica": 1, "recovery_s": 9.0}, {"replica": 2, "recovery_s": 15.0}, {"replica": None}]
    path.write_text(json.dumps(_summary(failure_events=events)))
    assert resolve(["--preset", "launch", "--summary", str(path)]).replica_restart_min == pytest.approx(12.0 / 60)
    path.write_text(json.dumps(_summary()))
    assert (cfg.gpus, cfg.replicas, cfg.mtbf_min, cfg.sync_stall_min) == (98_304, 12, 18.0, 10.0)

    path.write_text(json.dumps(_summary(detection_s=1.0, quorum_s=0.25)))
    assert resolve(["--preset", "launch", "--summary", str(path)]).ft_stall_min == pytest.approx(1.75 / 60)

    # 200,000 steps of 0.5 s: about 90 failures at the preset's 18-minute MTBF.
    args = ["--preset", "launch", "--summary", str(path), "--json", "--steps", "200000", "--step-s", "0.5"]
    assert main([*args, "--seeds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Seconds of stall instead of minutes: FT-HSDP loses far less than sync.
    assert out["ft-hsdp"]["ettr"] > 0.95 > out["sync"]["ettr"]


@pytest.mark.parametrize(
    "drop,overrides,names",
    [
        ("median_step_s", {}, "median_step_s"),
        ("max_healthy_stall_s", {}, "max_healthy_stall_s"),
        ("replicas", {}, "replicas"),
        ("failures", {}, "failures"),
        (None, {"failures": 0}, "failures"),
        (None, {"replicas": {"0": {"restarts": 1}}}, "catchup_s"),
        (None, {"replicas": {"0": {"catchup_s": 1.0, "restarts": 0}}}, "restarts"),
    ],
)
def test_launch_summary_errors_name_the_key(tmp_path, capsys, drop, overrides, names):
    summary = _summary(**overrides)
    summary.pop(drop, None)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert main(["--preset", "launch", "--summary", str(path)]) == 2
    assert names in capsys.readouterr().err


def test_table_output(capsys):
    assert main([*QUICK, "--restart-policy", "restart"]) == 0
    out = capsys.readouterr().out
    for name in STRATEGIES:
        assert name in out
    for heading in ("ETTR", "availability", "time-to-train ratio", "effective MTBF", "breakdown", "by cause"):
        assert heading in out


def test_json_has_the_new_outputs_and_strategies_can_be_chosen(capsys):
    assert main([*QUICK, "--json", "--strategies", "sync,spare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"sync", "spare"}
    for r in out.values():
        assert {"availability", "ttt_ratio", "effective_mtbf_min", "counts"} <= set(r)
        assert r["ttt_ratio"] == pytest.approx(1 / r["ettr"], rel=0.05)


def test_spare_preset_runs_its_strategies(capsys):
    assert main(["--preset", "spare-600k", "--json", "--seeds", "1", "--steps", "2000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"sync", "replication", "spare"}
    assert out["spare"]["ttt_ratio"] < out["replication"]["ttt_ratio"]


def test_from_run_predicts_the_recorded_run(capsys):
    assert main(["--from-run", RECORDED, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    summary = (
        json.loads((Path(RECORDED) / "summary.json").read_text())
        if (Path(RECORDED) / "summary.json").exists()
        else None
    )
    assert out["failures"] == 1
    assert abs(out["predicted_ettr"] - out["measured_ettr"]) <= 0.05, out
    if summary is not None:
        assert out["measured_ettr"] == pytest.approx(summary["ettr"], abs=1e-3)
    assert main(["--from-run", RECORDED]) == 0
    assert "measured" in capsys.readouterr().out


def test_sweep_writes_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["--sweep", str(png), "--json", *QUICK]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = json.loads(capsys.readouterr().out)
    assert out["over"] == "gpus"
    gpus = out["values"]
    assert 1_000 <= gpus[0] < 1_200 and 190_000 < gpus[-1] <= 200_000 and PAPER_100K["gpus"] in gpus
    assert set(out["ettr"]) == STRATEGIES and set(out["ttt_ratio"]) == STRATEGIES
    for series in out["ettr"].values():
        assert len(series) == len(gpus)
    # More GPUs, more failures: every strategy ends lower than it starts.
    assert all(s[-1] < s[0] for s in out["ettr"].values())


@pytest.mark.parametrize(
    "argv,values",
    [
        (["--sweep-over", "mtbf_min", "--sweep-values", "5,10,20"], [5.0, 10.0, 20.0]),
        (["--sweep-over", "restart-policy"], ["absorb", "queue", "restart"]),
        (["--sweep-over", "ft-stall-min"], [0.75, 1.5, 3.0, 6.0, 12.0]),
    ],
)
def test_sweep_over_any_input(tmp_path, capsys, argv, values):
    png = tmp_path / "sweep.png"
    assert main(["--sweep", str(png), "--json", *QUICK, "--strategies", "sync,ft-hsdp", *argv]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = json.loads(capsys.readouterr().out)
    assert out["values"] == values
    if out["over"] == "mtbf_min":  # a longer MTBF never hurts
        assert all(s == sorted(s) for s in out["ettr"].values())
