"""The packages' import graph: every module imports on its own, no module imports another that
(directly or not) imports it back, and layers import downward only (docs/style.md).

Function-level and ``TYPE_CHECKING`` imports count as edges too: a lazy import that hides a
cycle from the interpreter still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import _subproc

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchtune_pipe", "multiproc")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of module ``name`` (file ``path``) reads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    # ``from pkg import sub`` reads the submodule; ``from mod import name`` reads mod.
    return [f"{base}.{a.name}" for a in node.names] + [base]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports anywhere in its body.

    A submodule importing its own package's ``__init__`` is left out only where it reads a
    submodule through it (``from . import x``): the interpreter imports parents first anyway.
    """
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _imported(name, path, node)
            names = [t for t in targets[:-1] if t in modules] if len(targets) > 1 else []
            # The named submodules when they are modules, else the module imported from.
            for t in names or targets[-1:]:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def _is_package_parent(module: str, dep: str) -> bool:
    return module.startswith(dep + ".")


def test_no_import_cycle():
    graph = import_graph()
    assert "torchtune_pipe.loader.core" in graph and "multiproc.executor" in graph
    # Parents import their submodules to re-export them; a submodule reading a name from its
    # own package's __init__ closes a cycle the interpreter survives only by import order.
    graph = {m: {d for d in ds if not _is_package_parent(m, d)} for m, ds in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_submodules_import_names_from_modules_not_from_their_package():
    offenders = [
        (m, d)
        for m, ds in import_graph().items()
        for d in ds
        if _is_package_parent(m, d) and d in PACKAGES
    ]
    assert offenders == []


def test_layers_import_downward():
    graph = import_graph()
    up = sorted((m, d) for m, ds in graph.items() if m.startswith("multiproc") for d in ds)
    assert [(m, d) for m, d in up if d.startswith("torchtune_pipe")] == []


def test_no_tuner_imports_the_simulator():
    graph = import_graph()
    training = {"torchtune_pipe.tuning.intune.gym", "torchtune_pipe.tuning.intune.pretrain"}
    assert "torchtune_pipe.sim.model" in graph["torchtune_pipe.tuning.intune.pretrain"]
    tuners = [m for m in graph if m.startswith("torchtune_pipe.tuning") and m not in training]
    bad = sorted((m, d) for m in tuners for d in graph[m] if d.startswith("torchtune_pipe.sim"))
    assert bad == []


def test_the_checker_finds_a_cycle_hidden_in_a_function():
    tree = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(tree) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_imports_in_a_fresh_interpreter():
    # Each module first in its own interpreter would cost seconds apiece; one interpreter
    # importing them in sorted order still fails on a module that does not import on its own
    # unless an earlier one happened to set it up, which the cycle check above rules out.
    names = sorted(_modules())
    done = _subproc.run(
        f"""
        import importlib, traceback
        failed = []
        for name in {names!r}:
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc(limit=3))
        print("FAILED", failed)
        """,
        timeout_s=120.0,
    )
    assert done.returncode == 0, done.stderr
    assert "FAILED []" in done.stdout, done.stdout + done.stderr
