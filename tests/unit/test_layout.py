"""The package's shape (issue 31; docs/dev/layout.md, docs/design/index.md "Package layers"): imports run
down the layers, the runtime's types come without gRPC, functions stay short, docs/dev/layout.md names
every module, and ruff finds nothing."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

ROOT = Path(REPO)
PACKAGE = ROOT / "ftjax"
GENERATED = {"coordinator_pb2.py", "coordinator_pb2_grpc.py"}

# Lowest first. A module may import from its own layer and from the layers below, never above.
LAYERS = [
    {"ftjax.base"},
    {"ftjax.runs", "ftjax.config"},
    {"ftjax.coordinator", "ftjax.ftar"},
    {"ftjax.program"},
    {"ftjax.runtime"},
    {"ftjax.launch", "ftjax.sim"},
    {"ftjax.cli", "ftjax.api"},
    {"ftjax", "ftjax.__main__"},  # the root: the lazy Python API, `python -m ftjax`
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in GENERATED:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its first-level package, or the top-level module."""
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """Every ftjax module `module` imports, anywhere in its body (also inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ftjax"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            if base.split(".")[0] != "ftjax":
                continue
            if base == "ftjax":  # `from ftjax import x`: the submodule x, or a name of the root
                for a in node.names:
                    target = f"ftjax.{a.name}"
                    out.append((node.lineno, target if unit_of(target) in RANK else "ftjax"))
            else:
                out.append((node.lineno, base))
    return out


def test_every_module_sits_in_a_layer():
    strays = sorted({unit_of(m) for m in modules()} - set(RANK))
    assert not strays, f"place {strays} in a layer (LAYERS here, docs/dev/layout.md)"


def test_imports_run_down_the_layers():
    upward = []
    for module, path in modules().items():
        here = RANK[unit_of(module)]
        for line, target in imported(module, path):
            if target == "ftjax" and module.startswith("ftjax.cli"):
                continue  # `from ftjax import __version__` (a constant of the root, which imports nothing)
            there = RANK.get(unit_of(target))
            assert there is not None, f"{path}:{line}: imports {target}, which is in no layer"
            if there > here:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line}: {module} (layer {here}) imports {target} (layer {there})"
                )
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: an import inside a function, from a lower layer to a higher one, is found."""
    path = tmp_path / "net.py"
    path.write_text("def f():\n    from ftjax.runtime import replica\n    from . import env\n")
    assert imported("ftjax.base.net", path) == [(2, "ftjax.runtime"), (3, "ftjax.base")]
    assert RANK[unit_of("ftjax.runtime")] > RANK[unit_of("ftjax.base.net")]


def _loaded(modules: str, packages: tuple[str, ...]) -> list[str]:
    """Which of `packages` (or their submodules) a fresh interpreter holds after importing `modules`."""
    code = f"import sys\nimport {modules}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip())


def test_the_runtime_gets_its_coordinator_types_without_grpc():
    """The step protocol, the loop, the reducer and FTAR read quorums and coordinator errors from
    ftjax.coordinator.types: none of them loads gRPC (only the client, which talks to the server)."""
    runtime = (
        "ftjax.coordinator.types, ftjax.coordinator.codec, ftjax.ftar, ftjax.runtime.protocol, "
        "ftjax.runtime.trainer, ftjax.runtime.reduce, ftjax.runtime.manager"
    )
    assert _loaded(runtime, ("grpc",)) == []


def test_the_launcher_and_the_coordinator_start_without_jax():
    """The processes that only supervise (the launcher, the coordinator) load no JAX: importing it
    costs ~1.2 s of CPU at every start, and a job starts them often (tests, restarts)."""
    supervisors = "ftjax.launch.cli, ftjax.launch.supervisor, ftjax.coordinator.server, ftjax.cli.coordinator"
    assert _loaded(supervisors, ("jax", "jaxlib", "flax", "optax", "orbax")) == []


def test_catch_up_and_the_program_load_nothing_of_the_coordinator():
    """Catch-up serves its snapshots with base's BoundedHTTPServer, and the program hashes its layout
    with base's fingerprint: neither loads a module of the coordinator (its state, its page,
    Prometheus) to do so."""
    loaded = _loaded("ftjax.runtime.catchup, ftjax.program.step", ("ftjax", "prometheus_client"))
    assert [m for m in loaded if m.startswith(("ftjax.coordinator", "prometheus_client"))] == []


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({length} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def layout_block() -> str:
    return (ROOT / "docs" / "dev" / "layout.md").read_text().split("```", 2)[1]


def test_the_layout_page_names_every_module():
    """Each module of the package has its line in docs/dev/layout.md, under its package."""
    named, package = set(), None
    for line in layout_block().splitlines():
        top = re.match(r"^(ftjax/[\w/]*?)(\w+\.\w+)?\s", line + " ")
        if top and not line.startswith(" "):
            package = top.group(1)
            if top.group(2):
                named.add(top.group(1) + top.group(2))
            continue
        sub = re.match(r"^\s{2}([\w/]+\.\w+)\s", line)
        if sub and package:
            named.add(package + sub.group(1))
    wanted = {
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if p.name not in GENERATED and (p.name != "__init__.py" or p.parent == PACKAGE)
    }
    assert not wanted - named, f"modules missing from docs/dev/layout.md: {sorted(wanted - named)}"
    assert not named - wanted - {"ftjax/coordinator/coordinator.proto"}, (
        f"docs/dev/layout.md names modules that do not exist: {sorted(named - wanted)}"
    )


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a dev dependency (pip install -e '.[dev]')"
    done = subprocess.run([ruff, *command, "."], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their base name (rootdir-relative, no packages): two of one name
    in two tiers stop `make test` at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert not {n for n in names if names.count(n) > 1}
