"""The package's shape (issue 31; docs/dev/layout.md, docs/design/index.md "Package layers"): imports run
down the layers, no two modules import each other (directly or round a cycle, also from inside
functions: it fails on a planted cycle, and names its modules), nobody reaches through
`FaultTolerance` to its step protocol, the runtime's types come without gRPC, functions stay short,
docs/dev/layout.md names every module, and ruff finds nothing."""

from __future__ import annotations

import ast
import graphlib
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


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under `root` (default this checkout), by its dotted name."""
    out = {}
    for path in sorted((root / "ftjax").rglob("*.py")):
        if path.name in GENERATED:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its first-level package, or the top-level module."""
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def imported(module: str, path: Path, known: set[str] = frozenset()) -> list[tuple[int, str]]:
    """Every ftjax module `module` imports, anywhere in its body (also inside functions). With
    `known` (module names), `from ftjax.x import y` is the module ftjax.x.y when y is one of them."""
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
                out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
    return out


def module_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports: every Import and ImportFrom node of its AST,
    anywhere in its body, a name imported from a package resolved to its module when it is one.
    (A package's __init__ that Python runs on the way to a submodule is no edge: an __init__ that
    re-exports its submodules, ftjax/ftar/__init__.py, would make every sibling import a cycle.)"""
    return {
        module: {t for _, t in imported(module, path, set(mods)) if t in mods} - {module}
        for module, path in mods.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of `graph`, each as [a, b, ..., a] (a imports b, ...): graphlib finds one, its
    last import is set aside, and the search goes on until none is left, so that every cycle shows
    (several may share a module)."""
    graph = {m: set(targets) for m, targets in graph.items()}
    cycles = []
    while True:
        try:  # (graphlib: a module's imports are its predecessors)
            graphlib.TopologicalSorter(graph).prepare()
            return cycles
        except graphlib.CycleError as e:
            cycle = list(reversed(e.args[1]))  # (its list runs from an import to the importer)
            cycles.append(cycle)
            graph[cycle[-2]].discard(cycle[-1])


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


def test_no_import_cycle():
    """No module imports, through any chain of imports and also from inside a function, one that
    imports it: a cycle hides an order of initialization, and the layers say nothing inside a package."""
    cycles = import_cycles(module_graph(modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_planted_cycle(tmp_path):
    """The check itself: a package whose modules import each other round a cycle (a top-level
    `from package import module`, an import inside a function, a relative import) is reported, its
    modules named in the order of the imports; a module beside it that imports into the cycle is not."""
    pkg = tmp_path / "ftjax" / "x"
    pkg.mkdir(parents=True)
    (tmp_path / "ftjax" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ftjax.x import b\n")
    (pkg / "b.py").write_text("def f():\n    import ftjax.x.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from ftjax.x.a import something\n")
    graph = module_graph(modules(tmp_path))
    assert graph["ftjax.x.d"] == {"ftjax.x.a"} and graph["ftjax.x.a"] == {"ftjax.x.b"}
    cycles = import_cycles(graph)
    assert len(cycles) == 1 and len(cycles[0]) == 4, cycles
    start = cycles[0].index("ftjax.x.a")  # (graphlib may enter the cycle at any module)
    assert (cycles[0][:-1] * 2)[start : start + 3] == ["ftjax.x.a", "ftjax.x.b", "ftjax.x.c"]
    (pkg / "c.py").write_text("from ftjax.x import d\n")  # c -> d -> a -> b -> c: still one, longer
    assert sorted(import_cycles(module_graph(modules(tmp_path)))[0][:-1]) == [f"ftjax.x.{m}" for m in "abcd"]
    (pkg / "c.py").write_text("")
    assert import_cycles(module_graph(modules(tmp_path))) == []


# FaultTolerance (ftjax/runtime/manager.py) is the step protocol's one holder: there, and only on
# `self`, an attribute named `protocol` is read, one level deep (`self.protocol.agree()`). Anywhere else
# in the package (protocol.py aside, which is the protocol), `x.protocol` reaches through the object
# that owns the protocol, and `x.protocol.y.z` reaches through the protocol to a collaborator.
PROTOCOL_HOLDER = "ftjax/runtime/manager.py"
PROTOCOL_ITSELF = "ftjax/runtime/protocol.py"


def protocol_reaches(rel: str, source: str) -> list[str]:
    """Where module `rel` (path in the repository) reaches through to the step protocol."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or rel == PROTOCOL_ITSELF:
            continue
        if node.attr == "protocol":
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not (rel == PROTOCOL_HOLDER and on_self):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        inner = node.value  # x.protocol.collaborator.y
        if (
            isinstance(inner, ast.Attribute)
            and isinstance(inner.value, ast.Attribute)
            and inner.value.attr == "protocol"
        ):
            out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_nobody_reaches_through_fault_tolerance_to_its_protocol():
    reaches = [
        r for path in modules().values() for r in protocol_reaches(str(path.relative_to(ROOT)), path.read_text())
    ]
    assert not reaches, "reaching through FaultTolerance to its protocol:\n" + "\n".join(reaches)


def test_the_reach_check_sees_a_reach_through():
    """The check itself: the trainer's former `self.ft.protocol.step_fields()` and the owner's
    `self.protocol.reducer.tree(u)` are found; the owner's own one-level calls are not."""
    trainer = "def f(self):\n    return self.ft.protocol.step_fields()\n"
    assert protocol_reaches("ftjax/runtime/trainer.py", trainer) == ["ftjax/runtime/trainer.py:2: self.ft.protocol"]
    owner = "def f(self, u):\n    self.protocol.agree()\n    return self.protocol.reducer.tree(u)\n"
    assert protocol_reaches(PROTOCOL_HOLDER, owner) == [f"{PROTOCOL_HOLDER}:3: self.protocol.reducer.tree"]
    assert protocol_reaches(PROTOCOL_ITSELF, owner) == []


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
