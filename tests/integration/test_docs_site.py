"""The docs site builds, and the docs' runnable blocks run (issue 58).

`mkdocs build --strict` fails on a broken link, a page missing from the nav, or an API reference
whose object is gone. Code blocks preceded by `<!-- docs-test: file NAME -->` are written to NAME in
a fresh directory, and `<!-- docs-test: run -->` bash blocks are run there line by line, each line
exiting 0 (README.md and the pages under docs/): the quick start cannot drift from the code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ftjax.base.env import limited_env

ROOT = Path(REPO)
MARK = re.compile(r"<!-- docs-test: (file (?P<name>[\w./-]+)|run) -->\n```\w*\n(?P<body>.*?)\n```", re.S)


def test_the_docs_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "model.d_model" in config and "ft.global_batch" in config
    assert "--replicas" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def blocks(path: Path) -> list[tuple[str | None, str]]:
    return [(m.group("name"), m.group("body")) for m in MARK.finditer(path.read_text())]


def test_the_readme_marks_its_quick_start_runnable():
    kinds = [name or "run" for name, _ in blocks(ROOT / "README.md")]
    assert "quickstart.py" in kinds and "run" in kinds


@pytest.mark.timeout(960)
@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path):
    """README.md's own-model example: `python quickstart.py` trains it standalone, and the launch
    with a kill ends with digests equal and every batch exactly once."""
    env = {**limited_env(), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    for name, body in blocks(ROOT / "README.md"):
        if name:
            (tmp_path / name).write_text(body + "\n")
            if name.endswith(".py"):
                done = subprocess.run(
                    [sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
                )
                assert done.returncode == 0, done.stdout + done.stderr
                assert "final loss" in done.stdout
            continue
        for line in body.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                done = subprocess.run(
                    ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
                )
                assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    summary = (tmp_path / "runs" / "job" / "summary.json").read_text()
    import json

    s = json.loads(summary)
    assert s["digests_equal"] and s["exactly_once"]
    assert s["replicas"]["1"]["restarts"] >= 1
