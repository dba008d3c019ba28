"""The package's shape, kept: no import cycle, a core that imports neither Ray nor torch, modules and
classes small enough to read (400 and 200 lines), constructors of at most 6 arguments (the public
`RankGroup`'s keyword options aside)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

PKG = REPO / "launcher"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 200
MAX_INIT_ARGS = 6
WIDE_BY_DESIGN = {"RankGroup"}  # a public API's keyword options, as Ray's and torch's own


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imports(path: Path) -> set[str]:
    """Modules of this package that `path` imports: at module level, in functions, and for annotations
    only (`if TYPE_CHECKING:`), which is a cycle all the same to a reader."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("launcher"))
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if not module.startswith("launcher"):
                continue
            names = {f"{module}.{a.name}" for a in node.names}
            found.update(names)  # `from . import placement`
            if not all(_is_module(n) for n in names):  # not `from .. import driver`, which is the folder's
                found.add(module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _folder(module: str) -> str:
    """A module's folder (`launcher.driver`), or itself at the top (`launcher`, `launcher.__main__`)."""
    return ".".join(module.split(".")[:2])


def test_no_import_loop_between_folders():
    """The folders stack: core, then rank, megatron, driver, cli; none imports one above it (a rank
    that imported the Megatron target and a Megatron module that imported the rank's was such a loop)."""
    edges: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        for d in deps:
            if _folder(d) != _folder(m):
                edges.setdefault(_folder(m), set()).add(_folder(d))
    loops = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, set()))
    assert not loops, loops
    reach = {f: set(ds) for f, ds in edges.items()}
    for _ in range(len(reach)):
        for f in reach:
            reach[f] |= {x for d in list(reach[f]) for x in reach.get(d, ())}
    assert not [f for f in reach if f in reach[f]], edges


def test_core_imports_only_core_and_never_ray_or_torch():
    graph = _graph()
    for m, deps in graph.items():
        if m.startswith("launcher.core"):
            outside = sorted(d for d in deps if not d.startswith("launcher.core"))
            assert not outside, f"{m} imports {outside}"
    core = [_module_name(p) for p in (PKG / "core").glob("*.py")]
    code = (
        "import importlib, sys\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'megatron'))\n"
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_modules_and_classes_stay_readable():
    too_long = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(REPO)}: class {node.name} {n} lines")
            if isinstance(node, ast.ClassDef) and node.name not in WIDE_BY_DESIGN:
                for init in (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                    a = init.args
                    if (n := len(a.args) - 1 + len(a.kwonlyargs)) > MAX_INIT_ARGS:
                        too_long.append(f"{path.relative_to(REPO)}: {node.name}.__init__ takes {n} arguments")
    assert not too_long, too_long


def test_rays_private_apis_are_called_from_one_module():
    """driver/cluster/rayprivate.py says why each is needed; a Ray upgrade that moves one breaks
    there only."""
    private = ("ray._private", "ray._raylet", "ray.experimental.internal_kv")
    callers = []
    for path in PKG.rglob("*.py"):
        if path.name == "rayprivate.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # ray.experimental
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]  # ray._private.state.jobs()
            if any(n == p or n.startswith(p + ".") for n in names for p in private):
                callers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not callers, callers


def test_the_dashboard_libraries_are_found_as_ray_imports_them():
    """A Ray megaray starts asks whether the dashboard's libraries are installed by finding them, not
    importing them (rayprivate.dashboard_libraries_missing): the same libraries Ray's own check
    imports, and the same answer."""
    import importlib.util

    import ray._private.utils as ray_utils

    from launcher.driver.cluster.rayprivate import DASHBOARD_LIBRARIES, dashboard_libraries_missing

    origin = importlib.util.find_spec("ray.dashboard.optional_deps").origin
    imported = {a.name for n in ast.parse(Path(origin).read_text()).body if isinstance(n, ast.Import)
                for a in n.names}  # fmt: skip
    assert set(DASHBOARD_LIBRARIES) <= imported, imported
    # each of Ray's covered: found itself, or a module of it found, or a package found it is part of
    assert all(any(m == f or f.startswith(m + ".") or m.startswith(f + ".") for f in DASHBOARD_LIBRARIES)
               for m in imported), imported  # fmt: skip
    assert (dashboard_libraries_missing() is None) == (ray_utils.get_dashboard_dependency_error() is None)


def test_the_run_rays_config_keys_are_ones_the_installed_ray_knows():
    """A `_system_config` key Ray does not know makes its GCS exit as it starts, and every launch that
    starts its own Ray then fails after Ray's timeout (tried: ray.init with a misspelt key): the keys
    megaray passes (rayprivate.RUN_RAY_CONFIG) are names in the installed GCS's and raylet's binaries,
    where Ray's config table lives."""
    import ray

    from launcher.driver.cluster.rayprivate import RUN_RAY_CONFIG

    core = Path(ray.__file__).parent / "core" / "src" / "ray"
    for binary in (core / "gcs" / "gcs_server", core / "raylet" / "raylet"):
        data = binary.read_bytes()
        assert all(key.encode() in data for key in RUN_RAY_CONFIG), (binary, RUN_RAY_CONFIG)


def test_the_architecture_page_draws_every_state_and_the_folders_as_they_stack():
    """docs/architecture.md is kept true: its diagram names each state of the controller (and no
    other), and its layer table each folder with what it imports."""
    import re

    from launcher.core.lifecycle import LaunchState

    page = (REPO / "docs" / "architecture.md").read_text()
    diagram = page.split("```mermaid")[1].split("```")[0]
    drawn = set(re.findall(r"^\s*(\w+) --> (\w+)", diagram, re.M))
    named = {s for edge in drawn for s in edge} - {"*"}
    assert named == {s.value for s in LaunchState}, named ^ {s.value for s in LaunchState}
    table = page.split("## Layers")[1].split("```")[1]
    edges: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        for d in deps:
            if _folder(d) != _folder(m) and _folder(m).count(".") == 1:
                edges.setdefault(_folder(m).split(".")[1], set()).add(_folder(d).split(".")[1])
    for line in table.strip().splitlines():
        folder, _, imports = line.partition("imports")
        name = folder.split("/")[0]
        said = {w.strip(" ,") for w in imports.split(",")} - {"core only"}
        said = {w.split()[0] for w in said if w}
        assert edges.get(name, set()) <= said | {"core"} and said <= edges.get(name, set()) | {"core"}, (
            name,
            said,
            edges.get(name),
        )
