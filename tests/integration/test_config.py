import subprocess

import pytest
from conftest import FTJAX, REPO

from ftjax.cli.coordinator import parser as coordinator_parser
from ftjax.config import ConfigError, CoordinatorConfig, load_config, load_config_dict
from ftjax.coordinator.quorum import Settings


def test_defaults_and_overrides():
    cfg = load_config(f"{REPO}/configs/tiny.yaml", ["steps=7", "model.d_model=32", "optim.lr=1e-4"])
    assert (cfg.steps, cfg.model.d_model, cfg.optim.lr) == (7, 32, 1e-4)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model.d_model=-3"], "model.d_model"),
        (["model.widht=3"], "model.widht: unknown key"),
        (["steps=many"], "steps"),
        (["data.source=web"], "data.source"),
        (["mesh.devices_per_host=3"], "data.batch_size (8) must be divisible"),
        (["mesh.devices_per_host=8", "data.batch_size=16", "model.d_model=36"], "model.d_model (36) must be divisible"),
        (["model.n_heads=3"], "n_heads"),
        (["model=3"], "model"),
        (["nonsense"], "expected KEY=VALUE"),
        (
            ["coordinator.heartbeat_timeout_ms=2000"],
            "coordinator.heartbeat_timeout_ms: unknown key (renamed coordinator.heartbeat_timeout_s, in seconds)",
        ),
        (
            ["coordinator.join_timeout_ms=1000"],
            "coordinator.join_timeout_ms: unknown key (renamed coordinator.join_timeout_s",
        ),
        (["log_every=5"], "log_every: unknown key (removed"),
        (["ft.wire_dtype=float16"], "ft.wire_dtype: Input should be 'float32', 'bfloat16' or 'int8'"),
        (["ft.wire_dtype=int8"], "ft.wire_dtype=int8: only with ft.sync diloco or streaming_diloco"),
        (["ft.link_streams=0"], "ft.link_streams: Input should be greater than or equal to 1"),
        (["coordinator.heartbeat_timeout_s=0"], "coordinator.heartbeat_timeout_s: Input should be greater than 0"),
        (
            ["coordinator.suspect_window_s=2"],
            "coordinator: suspect_window_s (2) must be shorter than heartbeat_timeout_s (2)",
        ),
        # issue 26 item 9a: was accepted, and the process grew until the OS killed it
        (["data.batch_size=100000000"], "data.batch_size (100000000) x model.seq_len (64) = 6,400,000,000 tokens"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(f"{REPO}/configs/tiny.yaml", overrides)
    assert field in str(e.value)


def test_the_batch_bound_scales_with_the_devices():
    limit = 2**22 // 64  # rows of 64 tokens per device
    load_config(f"{REPO}/configs/tiny.yaml", [f"data.batch_size={limit}"])
    with pytest.raises(ConfigError, match="lower data.batch_size"):
        load_config(f"{REPO}/configs/tiny.yaml", [f"data.batch_size={2 * limit}"])
    load_config(f"{REPO}/configs/tiny.yaml", [f"data.batch_size={2 * limit}", "mesh.devices_per_host=2"])


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="optimiser: unknown key"):
        load_config_dict({"optimiser": {"lr": 1}})


def test_coordinator_settings_have_one_schema():
    """The config's `coordinator:` section is where the coordinator's settings and defaults live: the
    rules' Settings and the `ftjax coordinator` flags both take theirs from it."""
    c = CoordinatorConfig()
    assert (c.heartbeat_timeout_s, c.join_timeout_s, c.suspect_window_s) == (2.0, 1.0, 0.3)
    assert Settings() == Settings.from_config(c)
    defaults = coordinator_parser().parse_args([])
    assert {name: getattr(defaults, name) for name in CoordinatorConfig.model_fields} == c.model_dump()
    custom = CoordinatorConfig(min_replicas=2, heartbeat_timeout_s=1.5, join_timeout_s=0.25)
    args = coordinator_parser().parse_args(custom.flags())  # what the launcher passes
    assert {name: getattr(args, name) for name in CoordinatorConfig.model_fields} == custom.model_dump()
    assert Settings.from_config(custom, expected_replicas=3).expected_replicas == 3
    with pytest.raises(ValueError, match="coordinator.min_replicas"):
        Settings(min_replicas=0)


def _train(*args, cwd=REPO):
    return subprocess.run([*FTJAX, "train", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_cli_bad_value_exits_2_naming_field(tmp_path):
    r = _train("configs/tiny.yaml", "--out", str(tmp_path / "run"), "model.d_model=-3")
    assert r.returncode == 2, r.stderr
    assert "model.d_model" in r.stderr and "greater than 0" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_cli_unknown_key_in_file_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((open(f"{REPO}/configs/tiny.yaml").read()) + "\ndata:\n  batch_size: 8\n  shuffle_buffer: 10\n")
    r = _train(str(bad), "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert "data.shuffle_buffer: unknown key" in r.stderr
    assert r.stderr.count("\n") <= 2  # one clear line, no traceback


def test_cli_missing_file_exits_2(tmp_path):
    r = _train(str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "No such file" in r.stderr
