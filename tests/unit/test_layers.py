"""The layer rules, checked on the source: no import cycles, pure policies, and callers
that place requests without loading the node runtime or ONNX Runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("edgefleet", "cluster", "actors", "policies", "sim")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """Every project module ``path`` imports, at module level or inside functions and
    TYPE_CHECKING blocks alike (a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle.
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_policies_are_free_of_ray_onnx_runtime_and_the_other_layers():
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("policies"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                top = (mod or "").split(".")[0]
                assert top not in ("ray", "onnxruntime", "cluster", "actors"), (name, mod)


def loaded_after_import(modules: str, forbidden: tuple[str, ...]) -> list[str]:
    """Which of ``forbidden`` a fresh interpreter has loaded after importing ``modules``."""
    code = (
        f"import sys; import {modules}; "
        f"print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]


def test_callers_load_neither_the_node_runtime_nor_onnx_runtime():
    callers = "cluster.client, cluster.router, cluster.dispatch"
    assert loaded_after_import(callers, ("onnxruntime", "actors.node", "actors.engine")) == []


def test_the_simulator_loads_neither_ray_nor_onnx_runtime():
    simulator = "sim.fleet, sim.run, sim.workload, sim.report, sim.rollout"
    forbidden = ("ray", "onnxruntime", "actors.node", "actors.engine")
    assert loaded_after_import(simulator, forbidden) == []


def test_each_module_imports_first():
    """Each module imported before any other of the project's: a cycle through a
    package's ``__init__`` (which the import graph above does not see) fails here."""
    code = (
        "import importlib, sys\n"
        f"packages = {PACKAGES!r}\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in packages]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    # The packages whose __init__ imports other modules, and what they import (cheap:
    # none of them loads Ray).
    names = sorted(m for m in modules() if m.split(".")[0] in ("edgefleet", "policies", "sim"))
    done = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_every_bench_module_imports():
    """The benchmarks are outside the type-checked packages: a name they import that the
    product renamed fails here, not in the middle of a bench run."""
    import importlib

    for path in sorted((REPO / "bench").glob("*.py")):
        importlib.import_module(f"bench.{path.stem}")
