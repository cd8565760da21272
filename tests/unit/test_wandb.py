"""`log.wandb` (ftjax/runtime/tensorboard.py, ftjax/config.py): a replica leader's scalars go to a W&B
run as well, on the thread that writes the event files. wandb is not a dependency: a fake module in
sys.modules records what the run is told."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest


class FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, values: dict, step: int | None = None) -> None:
        self.calls.append(("log", dict(values), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch) -> list:
    """A `wandb` module whose init/log/finish calls land in the returned list."""
    calls: list = []
    module = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


RECORDS = [
    {"step": 1, "loss": 5.25, "lr": 1e-3, "participants": 2, "contributors": 2, "step_time_s": 0.5, "tokens": 400},
    {"step": 2, "loss": 4.5, "lr": 2e-3, "participants": 2, "contributors": 1, "step_time_s": 0.25, "tokens": 400},
    {"step": 3, "loss": 4.0, "lr": 3e-3, "participants": 1, "contributors": 1, "step_time_s": 0.2, "eval_loss": 4.125},
]


def test_the_records_scalars_go_to_a_wandb_run_per_replica_at_their_steps(fake_wandb, tmp_path, monkeypatch):
    from ftjax.config import load_config_dict
    from ftjax.runtime.args import RunOptions
    from ftjax.runtime.metrics import MetricsLog
    from ftjax.runtime.replica import record_sinks

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config_dict({"log": {"wandb": True, "wandb_project": "proj", "tensorboard": False}})
    run = tmp_path / "myrun"
    sinks = record_sinks(cfg, RunOptions(replica_id=1, coordinator="127.0.0.1:1"), run / "replica-1")
    assert sinks["tensorboard"] is None
    log = MetricsLog(run / "replica-1", **sinks)
    log.log(RECORDS[0])
    log.event("restore", step=1)
    for r in RECORDS[1:]:
        log.log(r)
    log.close()
    init = {"project": "proj", "name": "myrun-replica-1", "group": "myrun", "dir": str(run.resolve())}
    init["mode"] = "offline"
    assert fake_wandb[0] == ("init", init)
    logged = [c for c in fake_wandb if c[0] == "log"]
    assert [step for _, _, step in logged] == [1, 1, 2, 3]
    assert logged[1][1] == {"events/restore": 1.0}
    for r, (_, values, _) in zip(RECORDS, [logged[0], *logged[2:]]):
        assert values["train/loss"] == r["loss"] and values["lr"] == r["lr"]
        assert values["quorum/contributors"] == r["contributors"] and values["time/step_s"] == r["step_time_s"]
    assert logged[0][1]["tokens_per_s"] == 800.0 and logged[3][1]["eval/loss"] == 4.125
    assert fake_wandb[-1] == ("finish",) and fake_wandb.count(("finish",)) == 1


def test_wandb_and_tensorboard_get_the_same_scalars(fake_wandb, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ftjax.runtime.tensorboard import TensorBoardWriter, wandb_init

    writer = TensorBoardWriter(tmp_path / "tb", flush_s=0.1, wandb=wandb_init("p", tmp_path, 0))
    for r in RECORDS:
        writer.step(r)
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    board = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    wandb = {(tag, step): v for c in fake_wandb if c[0] == "log" for tag, v in c[1].items() for step in [c[2]]}
    assert set(board) == set(wandb) and len(board) > 3 * 5
    assert all(board[k] == pytest.approx(wandb[k], rel=1e-6) for k in board)  # (event files hold float32)


def test_log_wandb_without_the_package_stops_ftjax_train_at_startup(monkeypatch, capsys, tmp_path):
    from ftjax.cli import train
    from ftjax.config import ConfigError, load_config_dict

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"log\.wandb: .*pip install wandb"):
        load_config_dict({"log": {"wandb": True}})
    load_config_dict({"log": {"wandb": False}})  # off by default, and off needs nothing
    assert load_config_dict({}).log.wandb is False
    assert train.main(["tiny", "log.wandb=true", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "log.wandb" in err and "pip install wandb" in err and "Traceback" not in err
    assert not Path(tmp_path / "run").exists()
