"""The public API (`ftjax/__init__.py`): what the examples, and a user's own task, may import."""

from __future__ import annotations

import ast
from pathlib import Path

import ftjax

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _private_uses(path: Path) -> list[str]:
    """`import ftjax.x`, `from ftjax.x import ...` and `ftjax.NAME` for a NAME not in ftjax.__all__."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("ftjax.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ftjax."):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "ftjax":
            found += [f"from ftjax import {a.name}" for a in node.names if a.name not in ftjax.__all__]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ftjax":
            found += [f"ftjax.{node.attr}"] if node.attr not in ftjax.__all__ else []
    return [f"{path.name}:{use}" for use in found]


def test_the_examples_use_public_names_only():
    examples = sorted(EXAMPLES.glob("*.py"))
    assert len(examples) >= 3
    assert [use for path in examples for use in _private_uses(path)] == []


def test_the_scan_finds_a_private_import(tmp_path):
    (tmp_path / "x.py").write_text("import ftjax\nfrom ftjax.program.data import Windows\nftjax.program.data\n")
    assert _private_uses(tmp_path / "x.py") == ["x.py:from ftjax.program.data import ...", "x.py:ftjax.program"]


def test_the_token_file_names_resolve_and_are_documented():
    for name in ("TokenWindows", "TokenFileError", "Windows", "stdlib_corpus"):
        assert name in ftjax.__all__ and (getattr(ftjax, name).__doc__ or "").strip(), name
    assert ftjax.TokenWindows.__module__ == "ftjax.program.tokens" and issubclass(ftjax.TokenFileError, ValueError)


def test_run_args_parse_sets_the_platform_before_jax_is_imported():
    """`ftjax.RunArgs.parse` applies the config's platform and device count, which JAX reads once at
    import: so neither `ftjax.RunArgs` nor its module may import JAX (it lived beside the script's
    FaultTolerance, which does, and the settings were then skipped silently)."""
    import subprocess
    import sys

    code = (
        "import sys, ftjax\n"
        "parse = ftjax.RunArgs.parse\n"
        "assert 'jax' not in sys.modules, 'ftjax.RunArgs imported jax'\n"
        "parse(['tiny', 'platform=cpu', 'mesh.devices_per_host=4', '--out', 'x'])\n"
        "import jax\n"
        "print(jax.device_count())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4"]


def test_run_args_parse_refuses_a_multi_host_replica_naming_its_hosts():
    # (`ftjax launch --entry` refuses it before anything starts: tests/integration/test_launch_cli.py)
    import pytest

    with pytest.raises(ValueError, match=r"runs on one host, this one on 2 \(mesh.hosts=2\)"):
        ftjax.RunArgs.parse(["tiny", "mesh.hosts=2", "--dist-address", "10.9.0.1:4000", "--out", "x"])
