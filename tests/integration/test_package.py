"""The package works outside the repository: the wheel carries the built-in configs, the coordinator's
.proto and the LICENSE, and nothing of the run outputs or the tests; `ftjax --version` answers; a
config is a path or the name of a built-in one."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import FTJAX, REPO

from ftjax.cli.main import version
from ftjax.config import ConfigError, builtin_configs, load_config, resolve_config_path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the checkout (without its run outputs or an earlier build), so the build
    # leaves no build/ or *.egg-info here. --no-build-isolation: setuptools from this venv, no network.
    src = out / "src"
    shutil.copytree(
        REPO,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
        ),
    )
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("ftjax-*.whl")
    with zipfile.ZipFile(whl) as z:
        yield z


def test_wheel_contents(wheel):
    names = wheel.namelist()
    for needed in (
        "ftjax/configs/tiny.yaml",
        "ftjax/configs/gpt_small.yaml",
        "ftjax/coordinator/coordinator.proto",
        "ftjax/cli/main.py",
        "ftjax_bench/step.py",
    ):
        assert needed in names, needed
    (lic,) = [n for n in names if re.fullmatch(r"ftjax-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
    assert "Apache License" in wheel.read(lic).decode() and "Version 2.0" in wheel.read(lic).decode()
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = wheel.read(meta).decode()
    assert re.search(r"^License-Expression: Apache-2\.0$", metadata, re.M) or re.search(
        r"^License: Apache", metadata, re.M
    ), metadata[:2000]
    assert not [n for n in names if n.startswith(("runs/", "tests/", "configs/", "build/")) or "/runs/" in n]


def test_version_command():
    for arg in ("--version", "version"):
        r = subprocess.run([*FTJAX, arg], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"ftjax {version()}"
        assert re.fullmatch(r"ftjax \d+\.\d+\.\d+\S*", r.stdout.strip())


def test_builtin_configs_and_the_repo_symlink():
    assert {"tiny", "gpt_small"} <= set(builtin_configs())
    # The top-level configs/ (README, tests) is the package's configs/.
    assert Path(REPO, "configs", "tiny.yaml").resolve() == resolve_config_path("tiny").resolve()


def test_resolve_config_path(tmp_path, monkeypatch):
    builtin = resolve_config_path("tiny")
    assert builtin.name == "tiny.yaml" and builtin.parent.name == "configs" and builtin.is_file()
    assert resolve_config_path("tiny.yaml") == builtin
    assert load_config("gpt_small").model == load_config(resolve_config_path("gpt_small")).model

    # A path that exists wins over a built-in of the same name, relative or absolute.
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(builtin.read_text().replace("steps:", "steps: 3 #", 1))
    assert resolve_config_path("tiny.yaml") == Path("tiny.yaml") and load_config("tiny.yaml").steps == 3
    assert resolve_config_path(tmp_path / "tiny.yaml") == tmp_path / "tiny.yaml"
    assert resolve_config_path("tiny") == builtin  # no file called `tiny` here

    # Neither a file nor a built-in: the error names what was not found and lists the built-ins.
    for missing in ("nope", "nope.yaml", str(tmp_path / "nope.yaml"), "sub/tiny.yaml"):
        with pytest.raises(ConfigError) as e:
            resolve_config_path(missing)
        assert missing in str(e.value) and "No such file" in str(e.value)
        assert "tiny" in str(e.value) and "gpt_small" in str(e.value)
