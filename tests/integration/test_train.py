"""One replica trains for real: loss falls, sharding changes no numbers, resume is bitwise."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FTJAX, REPO

from ftjax.base.procs import free_port
from ftjax.cli.train import build_parser, main, parse_config, run_standalone
from ftjax.runtime.args import process_flags
from ftjax.runtime.metrics import read_metrics

TINY = f"{REPO}/configs/tiny.yaml"


def run_inprocess(out, *argv):
    args = build_parser().parse_intermixed_args([TINY, "--out", str(out), *argv])
    assert run_standalone(parse_config(args), args, out) == 0
    return read_metrics(out / "metrics.jsonl"), json.loads((out / "summary.json").read_text())


def losses(records):
    return np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
    """Reference: 1 process x 4 devices, 12 steps."""
    return run_inprocess(tmp_path_factory.mktemp("d4"), "steps=12", "mesh.devices_per_host=4")


@pytest.mark.timeout(420)
def test_cli_tiny_trains_and_its_output_redirected_to_a_file_is_a_readable_log(tmp_path):
    """`ftjax train configs/tiny.yaml --out RUN > log`: it trains, and the log (stdout is a file, not
    a terminal) has plain lines: the progress every few steps and the final loss."""
    run = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        r = subprocess.run(
            [*FTJAX, "train", "configs/tiny.yaml", "--out", str(run), "steps=30"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.PIPE,
            text=True,
            timeout=240,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    text = (tmp_path / "log").read_text()
    lines = text.splitlines()
    summary = json.loads((run / "summary.json").read_text())
    assert 5 <= len(lines) <= 40, text
    assert any("step 1/30  loss " in line for line in lines) and any("step 30/30  loss " in line for line in lines)
    assert f"final loss {summary['final_loss']:.4f}" in lines[-1], text
    assert "done: 30 steps" in lines[-1], text
    assert "\x1b" not in text, "no terminal escapes in a file"
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 31)), [r["step"] for r in recs]
    assert recs[-1]["loss"] <= 0.8 * recs[0]["loss"], (recs[0]["loss"], recs[-1]["loss"])
    assert [r["batch_id"] for r in recs] == list(range(30))
    # the same command again, without --resume: refused in one line; the run is untouched
    before = (run / "metrics.jsonl").read_bytes()
    again = subprocess.run(
        [*FTJAX, "train", "configs/tiny.yaml", "--out", str(run), "steps=30"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "already holds a run (metrics.jsonl" in again.stderr, again.stderr[-2000:]
    assert "--resume continues it" in again.stderr and (run / "metrics.jsonl").read_bytes() == before
    assert all(r["step_time_s"] > 0 for r in recs)


def test_device_count_changes_no_numbers(tmp_path, four_devices):
    one, _ = run_inprocess(tmp_path, "steps=12", "mesh.devices_per_host=1")
    four, summary4 = four_devices
    assert summary4["devices"] == 4
    np.testing.assert_allclose(losses(four), losses(one), rtol=1e-5, atol=0)
    assert losses(one)[-1] < losses(one)[0]


def test_two_processes_match_one(tmp_path, procs, four_devices):
    port = free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    children = [
        procs.start(
            [
                *FTJAX,
                "train",
                TINY,
                "--out",
                str(tmp_path / "run"),
                "steps=12",
                "mesh.devices_per_host=2",
                *process_flags(2, i, f"127.0.0.1:{port}"),
            ],
            device_count=2,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for i, c in enumerate(children):
        assert c.wait(timeout=240) == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["processes"], summary["devices"]) == (2, 4)
    np.testing.assert_allclose(losses(recs), losses(four_devices[0]), rtol=1e-5, atol=0)


def test_resume_is_bitwise(tmp_path):
    ck = ["steps=30", "checkpoint.every=10"]
    _, straight = run_inprocess(tmp_path / "straight", *ck)
    first, _ = run_inprocess(tmp_path / "resumed", *ck, "--stop-after", "20")
    assert first[-1]["step"] == 20
    _second, resumed = run_inprocess(tmp_path / "resumed", *ck, "--resume")
    recs = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 31)), [r["step"] for r in recs]
    assert [r["batch_id"] for r in recs] == list(range(30))  # the data stream resumed where it stopped
    assert resumed["param_digest"] == straight["param_digest"]
    assert resumed["final_loss"] == straight["final_loss"]
    # resumed once more, with nothing left to run: the summary still names the state's step
    _third, again = run_inprocess(tmp_path / "resumed", *ck, "--resume")
    assert again["steps"] == 0 and again["final_step"] == 30 and again["param_digest"] == straight["param_digest"]


def test_resume_with_no_checkpoint_starts_from_the_seed_and_says_where_it_looked(tmp_path):
    run_inprocess(tmp_path / "fresh", "steps=1", "--resume")
    events = [json.loads(line) for line in (tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()]
    (init,) = [e for e in events if e.get("event") == "init"]
    assert init["no_checkpoint_in"] == str((tmp_path / "fresh" / "checkpoints").absolute()), init


def test_resume_of_a_run_with_no_checkpoint_is_refused_and_says_where_it_looked(tmp_path, capsys):
    """A run with trained steps and no checkpoint (checkpoint.every=0): --resume would start from the
    seed and log step 1 a second time. Refused (exit 2, one line naming both places), nothing written."""
    out = tmp_path / "run"
    run_inprocess(out, "steps=2")
    before = (out / "metrics.jsonl").read_bytes()
    assert main([TINY, "--out", str(out), "steps=4", "--resume"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(out / "metrics.jsonl") in line and str(out / "checkpoints") in line, line
    assert "checkpoint.dir" in line and "step 2" in line, line
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing trained, nothing appended


# The limit is set by a small launcher that then execs the command, not in a preexec_fn: that makes
# subprocess fork() this test process, and where an earlier test of this worker left gRPC threads
# (a coordinator served in-process), gRPC's fork handlers restarted its poller in the child, which
# aborted on a descriptor subprocess had closed before the exec (SIGABRT, "epoll_wait error: Bad
# file descriptor"). An ignored SIGXFSZ and the limit both hold across exec.
_LIMITED = (
    "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def _limited_files(limit: int, argv: list[str]) -> list[str]:
    """`argv` whose files can grow to `limit` bytes only: a longer write fails with EFBIG ("File too
    large"; SIGXFSZ ignored), as on a full disk, deterministically and without a mount."""
    return [sys.executable, "-c", _LIMITED, str(limit), *argv]


@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("limit", "overrides", "names"),
    [
        (64 << 10, ["steps=12", "checkpoint.every=5"], ["(checkpoint.dir", "checkpoints/5.orbax-checkpoint-tmp/"]),
        (4 << 10, ["steps=20"], ["metrics.jsonl", "(--out "]),
    ],
    ids=["checkpoint", "metrics"],
)
def test_a_write_that_fails_is_one_line_naming_the_path(tmp_path, limit, overrides, names):
    """A checkpoint save, or the run's records, on a disk with no room: exit 1 and one line naming
    the file and the setting at fault; orbax's tracebacks (~470 lines) and ours are off the terminal."""
    out = tmp_path / "run"
    r = subprocess.run(
        _limited_files(limit, [*FTJAX, "train", TINY, "--out", str(out), *overrides]),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() and "compilation cache" not in ln]
    assert len(errors) == 1 and errors[0].startswith("ftjax train: error: "), r.stderr[-3000:]
    assert all(n in errors[0] for n in names), errors
    assert "File too large" in errors[0] and str(out) in errors[0], errors
    assert "ftjax/cli/train.py" not in r.stderr and "ERROR:" not in r.stderr, r.stderr[-3000:]


def test_a_wrong_coordinator_address_is_one_clear_error(tmp_path):
    """Issue 26 item 9e: a raw traceback after ft.quorum_timeout_s (120 s by default)."""
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    r = subprocess.run(
        [
            *FTJAX,
            "train",
            "configs/tiny.yaml",
            "--replica-id",
            "0",
            "--coordinator",
            address,
            "--out",
            str(tmp_path),
            "ft.quorum_timeout_s=2",
        ],
        cwd=REPO,
        env={**os.environ, "FTJAX_TOKEN": "t0ken"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and f"{address} (--coordinator)" in errors[0], r.stderr[-3000:]
    assert "ft.quorum_timeout_s" in errors[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
