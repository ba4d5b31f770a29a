"""No import cycles among the package's modules.

Every ``import`` of a ``vllm_lookahead`` module counts, at module level or
inside a function (a deferred import is still a dependency: it only hides
the cycle until the function runs), ``if TYPE_CHECKING`` blocks included.
The modules are parsed with :mod:`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "vllm_lookahead"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root``
    (``pkg/__init__.py`` is the module ``pkg``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` stands for: itself, or the longest
    enclosing module that exists (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package upwards
                base = module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # ``from pkg import mod`` imports the submodule ``pkg.mod``;
            # ``from pkg.mod import name`` the module ``pkg.mod``.
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src
                       for a in node.names]
        else:
            continue
        for t in targets:
            dep = _resolve(t, modules)
            if dep is not None and dep != module:
                out.add(dep)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan),
    each sorted; a cycle of imports lies within one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert f"{PACKAGE}.proposer" in graph  # the parse found the package
    assert f"{PACKAGE}.stats" in graph[f"{PACKAGE}.patches"]
    assert find_cycles(graph) == []


def test_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_no_module_imports_numba():
    """vLLM 0.32's CPU worker start-up (``register_triton_kernel_overrides``)
    scans every loaded module and fails on llvmlite's library object once
    numba is imported: a second engine in the process could not start
    (a numba-jitted kernel tried here broke the end-to-end tests). No
    module of the package may import numba or llvmlite, at any level."""
    modules = module_names()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in ("numba", "llvmlite") for n in names), module
