"""Every test's own waits end before pytest-timeout's: a slow run then fails with the test's message
and the output of what it started, not with pytest-timeout's stack dump.

A test bounds its processes with waits written in it (`proc.wait(timeout=400)`,
`launch.wait_for(pred, timeout=300)`, `subprocess.run(..., timeout=600)`); pytest-timeout (the
`timeout` in pyproject.toml, or a test's or module's `pytest.mark.timeout`) is the backstop for a
hang that no wait covers. The backstop must leave room for all of a test's waits in turn plus its
set-up and teardown, or it fires first and the test's own diagnosis is lost.

What this reads: numbers written in a test function's body as a `timeout=` argument or as a
`.wait(N)`/`.wait_for(pred, N)` argument, summed (waits in different branches of a parametrized test
count together, and one in a loop counts once). Waits inside helpers are the helper's business: the
tests' helpers (launchrun.py, ftjob.py) take no default timeout."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from conftest import REPO

TESTS = Path(REPO) / "tests"
# set-up, teardown and the time between a test's waits (starting processes, reading their logs)
MARGIN_S = 60


def _timeout_mark(decorators: list[ast.expr]) -> float | None:
    for decorator in decorators:
        for node in ast.walk(decorator):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "timeout"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                return float(node.args[0].value)
    return None


def _module_mark(tree: ast.Module) -> float | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return _timeout_mark([node.value])
    return None


def _number(node: ast.expr) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def written_waits(function: ast.FunctionDef) -> list[tuple[int, float]]:
    """(line, seconds) of each wait written in the function's body."""
    waits = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg == "timeout" and (seconds := _number(keyword.value)) is not None:
                waits.append((node.lineno, seconds))
        name = node.func.attr if isinstance(node.func, ast.Attribute) else None
        position = {"wait": 0, "wait_for": 1}.get(name or "")
        if position is not None and len(node.args) > position and (seconds := _number(node.args[position])):
            waits.append((node.lineno, seconds))
    return sorted(waits)


def short_backstops(root: Path, default: float) -> list[str]:
    found = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module = _module_mark(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            waits = written_waits(node)
            limit = _timeout_mark(node.decorator_list) or module or default
            if waits and sum(s for _, s in waits) + MARGIN_S > limit:
                lines = ", ".join(f"{s:g} s at line {line}" for line, s in waits)
                found.append(f"{path.relative_to(root)}::{node.name}: pytest-timeout {limit:g} s, waits {lines}")
    return found


def default_timeout() -> float:
    config = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())
    return float(config["tool"]["pytest"]["ini_options"]["timeout"])


def test_pytest_timeout_outlasts_every_tests_own_waits():
    found = short_backstops(TESTS, default_timeout())
    assert not found, (
        f"each needs @pytest.mark.timeout(at least its waits + {MARGIN_S} s), or shorter waits:\n" + "\n".join(found)
    )


def test_the_scan_finds_a_wait_the_backstop_cuts_short_and_passes_one_a_mark_covers(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_a(proc, launch):\n    proc.wait(timeout=250)\n    launch.wait_for(done, 30)\n"
        "@pytest.mark.timeout(400)\n"
        "def test_b(proc, launch):\n    proc.wait(timeout=250)\n    launch.wait_for(done, 30)\n"
        "def test_c(proc):\n    proc.wait(5)\n"
        "def helper(proc):\n    proc.wait(timeout=900)\n"
    )
    assert short_backstops(tmp_path, 300) == [
        "test_x.py::test_a: pytest-timeout 300 s, waits 250 s at line 3, 30 s at line 4"
    ]
    (tmp_path / "test_y.py").write_text(
        "import pytest\npytestmark = [pytest.mark.timeout(100)]\ndef test_d(p):\n    p.wait(50)\n"
    )
    assert short_backstops(tmp_path, 300)[1:] == ["test_y.py::test_d: pytest-timeout 100 s, waits 50 s at line 4"]
