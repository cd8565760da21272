"""A durable checkpoint is verified against the checksums recorded at save: a corrupt or incomplete
one is reported (an event and one stderr line naming the step and the file) and the newest intact
one is restored; none intact is one clear error."""

import json
import shutil

import pytest
from conftest import REPO

from ftjax.cli.train import build_parser, parse_config, run_standalone
from ftjax.runtime import checkpoint

TINY = f"{REPO}/configs/tiny.yaml"


def train(out, *argv):
    args = build_parser().parse_intermixed_args([TINY, "--out", str(out), *argv])
    return run_standalone(parse_config(args), args, out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """RUN/checkpoints of the tiny config with checkpoints at steps 10 and 20."""
    out = tmp_path_factory.mktemp("saved")
    assert train(out, "steps=20", "checkpoint.every=10") == 0
    return out / "checkpoints"


def largest_state_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(step_dir):  # 4 KiB of a state file inverted, as in the issue (its size is kept)
    path = largest_state_file(step_dir)
    data = bytearray(path.read_bytes())
    data[1000:5096] = bytes(b ^ 0xFF for b in data[1000:5096])
    path.write_bytes(bytes(data))
    return path


def truncate(step_dir):
    path = largest_state_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def garbage_metadata(step_dir):
    path = step_dir / "state" / "_METADATA"
    path.write_text("{ not json at all")
    return path


def delete_state(step_dir):
    shutil.rmtree(step_dir / "state")
    return step_dir / "state"


def empty_seal(step_dir):  # a seal that lists no file vouches for nothing
    path = step_dir / checkpoint.CHECKSUMS
    path.write_text("{}")
    return path


def partial_seal(step_dir):  # a seal that leaves the largest state file out: that file goes unchecked
    path = step_dir / checkpoint.CHECKSUMS
    recorded = json.loads(path.read_text())
    del recorded[str(largest_state_file(step_dir).relative_to(step_dir))]
    path.write_text(json.dumps(recorded))
    flip(step_dir)  # (and damaged: only the seal can tell)
    return path


def events(run_dir, kind):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == kind]


@pytest.mark.parametrize("damage", [flip, truncate, garbage_metadata, delete_state, empty_seal, partial_seal])
def test_a_corrupt_checkpoint_falls_back_to_the_older_intact_one(tmp_path, saved, capsys, damage):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(saved, ckpts)
    damaged = damage(ckpts / "20")
    assert train(tmp_path, "steps=22", "checkpoint.every=10", "--resume") == 0
    [bad] = events(tmp_path, "checkpoint_corrupt")
    assert bad["step"] == 20 and bad["file"].startswith(str(damaged)), bad
    [restore] = events(tmp_path, "restore")
    assert restore["restored_step"] == 10 and restore["data_position"] == 10, restore
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "corrupt" in ln]
    assert len(lines) == 1 and "step 20" in lines[0] and str(damaged) in lines[0], lines
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(11, 23)) and all(x < 10 for x in losses.values()), losses  # no NaN
    # the bad one was put aside, and step 20 saved afresh when the job reached it again
    assert len(list((ckpts / "corrupt").iterdir())) == 1
    checkpoint.verify(ckpts / "20", 20)


def test_no_intact_checkpoint_is_one_clear_error(tmp_path, saved):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(saved, ckpts)
    flip(ckpts / "20")
    truncate(ckpts / "10")
    with pytest.raises(checkpoint.NoIntactCheckpoint) as exc:
        train(tmp_path, "steps=22", "checkpoint.every=10", "--resume")
    assert isinstance(exc.value, checkpoint.CheckpointError)  # what `ftjax train` prints without a traceback
    msg = str(exc.value)
    assert "no intact checkpoint" in msg and str(ckpts) in msg and "20, 10" in msg, msg
    assert [e["step"] for e in events(tmp_path, "checkpoint_corrupt")] == [20, 10]
    assert not events(tmp_path, "restore") and not (tmp_path / "summary.json").exists()
