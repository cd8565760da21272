import subprocess

import pytest

from ftjax.config import ConfigError, load_config, load_config_dict

from conftest import FTJAX, REPO


def test_defaults_and_overrides():
    cfg = load_config(f"{REPO}/configs/tiny.yaml", ["steps=7", "model.d_model=32", "optim.lr=1e-4"])
    assert (cfg.steps, cfg.model.d_model, cfg.optim.lr) == (7, 32, 1e-4)


@pytest.mark.parametrize("overrides, field", [
    (["model.d_model=-3"], "model.d_model"),
    (["model.widht=3"], "model.widht: unknown key"),
    (["steps=many"], "steps"),
    (["data.source=web"], "data.source"),
    (["mesh.devices_per_host=3"], "data.batch_size (8) must be divisible"),
    (["mesh.devices_per_host=8", "data.batch_size=16", "model.d_model=36"], "model.d_model (36) must be divisible"),
    (["model.n_heads=3"], "n_heads"),
    (["model=3"], "model"),
    (["nonsense"], "expected KEY=VALUE"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(f"{REPO}/configs/tiny.yaml", overrides)
    assert field in str(e.value)


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="optimiser: unknown key"):
        load_config_dict({"optimiser": {"lr": 1}})


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
