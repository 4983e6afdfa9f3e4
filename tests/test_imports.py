"""The package's modules depend on each other one way: no import cycle between modules (function-
local imports included), and no module imports another module's underscore names (tests,
benchmarks and examples included: what they need is public)."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders and the module names they install as (pyproject.toml's package-dir).
PACKAGES = {"autopar": "autopar", "passes": "autopar.passes", "solver": "autopar.solver",
            "runtime": "autopar.runtime", "tests": "tests", "benchmarks": "benchmarks",
            "examples": "examples"}


def _modules() -> dict[str, str]:
    """module name -> file path, for every first-party module."""
    out = {}
    for folder, name in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([name, *parts])] = os.path.join(dirpath, f)
    return out


def _imports(module: str, path: str, modules: dict) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every import in the file, resolved to
    first-party modules where it names one."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [a.name for a in node.names]
            # `from pkg import mod` imports a module
            subs = [n for n in names if f"{base}.{n}" in modules]
            for n in subs:
                out.append((f"{base}.{n}", [], node.lineno))
            out.append((base, [n for n in names if n not in subs], node.lineno))
    return out


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for module, path in modules.items():
        for target, names, line in _imports(module, path, modules):
            if target not in modules:
                continue
            if target != module:
                edges[module].add(target)
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != module:
                    private.append(f"{os.path.relpath(path, ROOT)}:{line} imports {n} from "
                                   f"{target}")
    return modules, edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _is_package(module: str, modules: dict) -> bool:
    return modules[module].endswith("__init__.py")


def test_no_import_cycle_between_modules():
    modules, edges, _ = _graph()
    # A package's __init__ re-exporting its modules is not a dependency of theirs on it.
    plain = {m: {t for t in ts if not (_is_package(t, modules) and m.startswith(t + "."))}
             for m, ts in edges.items()}
    cycles = _cycles(plain)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_underscore_names():
    _, _, private = _graph()
    assert not private, "\n".join(private)


def test_the_stages_depend_one_way():
    """passes and solver never import runtime; solver never imports the FX rewrite; nothing in
    the package imports tests, benchmarks or examples."""
    modules, edges, _ = _graph()
    bad = []
    for m, targets in edges.items():
        for t in targets:
            if m.startswith(("autopar.passes", "autopar.solver")) and \
                    t.startswith("autopar.runtime"):
                bad.append((m, t))
            if m.startswith("autopar.solver") and t in ("autopar.passes.rewrite",
                                                         "autopar.passes.pipeline_split"):
                bad.append((m, t))
            if m.startswith("autopar") and t.startswith(("tests", "benchmarks", "examples")):
                bad.append((m, t))
    assert not bad, bad
