"""`ftjax plan` and MFU as a user meets them: real processes on this CPU-only machine."""

import json
import subprocess

from conftest import FTJAX, REPO

from ftjax.config import load_config
from ftjax.program.plan import plan_program
from ftjax.program.step import build_program
from ftjax.runtime.metrics import read_metrics


def ftjax(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FTJAX, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_plan_tiny_prints_its_numbers_and_they_are_the_in_process_plan():
    table = ftjax("plan", "tiny")
    assert table.returncode == 0, table.stderr
    for row in ("parameters                137,216", "state per device", "activations, temporaries", "FLOPs per token"):
        assert row in table.stdout, table.stdout
    assert "verdict" not in table.stdout  # no device named: the numbers alone
    done = ftjax("plan", "tiny", "--json", "--device-kind", "NVIDIA H100 80GB HBM3")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    report = json.loads(line)
    here = plan_program(build_program(load_config("tiny")), backward=True)  # the same config, one device, here
    for key in (
        "params",
        "param_bytes",
        "optimizer_bytes",
        "state_bytes",
        "batch_bytes",
        "update_bytes",
        "backward_bytes",
    ):
        assert report[key] == getattr(here, key), key
    assert report["temp_bytes"] == here.temp_bytes and report["flops_per_step"] == here.flops_per_step
    assert report["fits"] is True and report["verdict"].startswith("fits NVIDIA H100 SXM 80GB HBM3 (80.00 GiB)")
    assert report["device"]["peak_bf16_flops"] == 989.5e12 and report["step_s_at_peak"] > 0


def test_plan_on_a_larger_mesh_shards_the_state():
    one = json.loads(ftjax("plan", "gpt_small", "--json").stdout)
    four = json.loads(ftjax("plan", "gpt_small", "--json", "--hosts", "2", "--devices-per-host", "2").stdout)
    assert one["devices"] == 1 and four["devices"] == 4 and four["hosts"] == 2
    assert one["params"] == four["params"] == 14_442_496
    assert four["param_bytes"] < one["param_bytes"] / 3  # FSDP: about a quarter (biases off `embed` replicated)
    assert 0.95 < one["flops_per_token"] / one["closed_form_flops_per_token"] < 1.1


def test_a_config_that_does_not_fit_is_refused_with_exit_2_and_the_numbers():
    done = ftjax("plan", "gpt_small", "--device-memory-gib", "0.25")
    assert done.returncode == 2, done.stdout + done.stderr
    [err] = done.stderr.splitlines()
    assert err.startswith("ftjax plan: error: gpt_small: does not fit a device (256.00 MiB): "), err
    assert " per device (state 165.28 MiB + batch " in err and " over" in err, err
    assert "verdict                   does not fit" in done.stdout  # the table is printed too


def test_a_step_record_carries_mfu_when_a_peak_is_set_and_not_on_cpu_without_one(tmp_path):
    for name, extra in (("peak", ["hardware.peak_flops_per_device=1e12"]), ("cpu", [])):
        done = ftjax("train", "tiny", "steps=3", "platform=cpu", *extra, "--out", str(tmp_path / name))
        assert done.returncode == 0, done.stderr[-3000:]
    with_peak = read_metrics(tmp_path / "peak" / "metrics.jsonl")
    assert len(with_peak) == 3
    for r in with_peak:
        assert r["model_flops_per_step"] > 0
        assert r["mfu"] == round(r["model_flops_per_step"] / (r["step_time_s"] * 1 * 1e12), 6)
    summary = json.loads((tmp_path / "peak" / "summary.json").read_text())
    assert summary["median_mfu"] is not None and summary["median_mfu"] > 0
    on_cpu = read_metrics(tmp_path / "cpu" / "metrics.jsonl")
    assert all("mfu" not in r and r["model_flops_per_step"] > 0 for r in on_cpu)
    assert json.loads((tmp_path / "cpu" / "summary.json").read_text())["median_mfu"] is None
