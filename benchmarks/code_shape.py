"""The shape of the library's code: what a newcomer has to hold in their head.

    python -m benchmarks.code_shape [--list]

Counts, over autopar/, passes/, solver/ and runtime/: files over 700 lines, functions over 100
lines (a function whose docstring or first comment gives the reason it is long is counted
apart), the largest class, and mutable module-level state: module-level names bound to a dict,
list, set, a threading.local or a cache, and `global` statements. With --list it names each.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOTS = ("autopar", "passes", "solver", "runtime")
FILE_LINES, FUNCTION_LINES = 700, 100
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "local", "WeakKeyDictionary",
                 "WeakValueDictionary", "Counter", "deque"}


def files(root: Path) -> list[Path]:
    """The library's Python files, sorted."""
    return sorted(p for r in ROOTS for p in (root / r).rglob("*.py"))


def long_functions(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(qualified name, lines, has a stated reason) of every function over FUNCTION_LINES."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1
                    if n > FUNCTION_LINES:
                        doc = ast.get_docstring(child) or ""
                        out.append((name, n, "long because" in doc.lower()))
                visit(child, name + ".")
    visit(tree, "")
    return out


def module_state(tree: ast.Module, text: str, library: str) -> list[str]:
    """Mutable module-level state: lower-case names bound to a mutable value, any module-level
    name the library writes through (`X[k] = `, `X.attr = `, `X.append(` ...), and `global`."""
    out = []
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        if not names or not isinstance(value, (ast.Call, ast.Dict, ast.List, ast.Set,
                                               ast.DictComp, ast.ListComp, ast.SetComp)):
            continue
        called = ""
        if isinstance(value, ast.Call):
            f = value.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        for n in names:
            written = re.search(rf"\b{n}(\[[^\]]*\]|\.\w+) *[-+|]?= |\b{n}\.(append|update|"
                                rf"setdefault|add|pop|clear|extend|discard)\(|setattr\({n}\b",
                                library)
            if written or (not n.isupper() and called in MUTABLE_CALLS | {""}):
                out.append(f"{n} (line {node.lineno}{', written' if written else ''})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.append(f"global {','.join(node.names)} (line {node.lineno})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true", help="name every item counted")
    ap.add_argument("--root", default=".")
    args = ap.parse_args()
    root = Path(args.root)
    big, funcs, state, classes, total = [], [], [], [], 0
    library = "\n".join(p.read_text() for p in files(root))
    for path in files(root):
        text = path.read_text()
        lines = text.count("\n")
        total += lines
        rel = path.relative_to(root)
        if lines > FILE_LINES:
            big.append(f"{rel} ({lines})")
        tree = ast.parse(text)
        funcs += [(f"{rel}:{n}", k, why) for n, k, why in long_functions(tree)]
        state += [f"{rel}: {s}" for s in module_state(tree, text, library)]
        classes += [(n.end_lineno - n.lineno + 1, f"{rel}:{n.name}")
                    for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    classes.sort(reverse=True)
    unexplained = [f for f in funcs if not f[2]]
    print(f"library lines                 {total}")
    print(f"files over {FILE_LINES} lines          {len(big)}")
    print(f"functions over {FUNCTION_LINES} lines      {len(unexplained)} "
          f"(+{len(funcs) - len(unexplained)} with a stated reason)")
    print(f"largest class                 {classes[0][1]} ({classes[0][0]} lines)")
    print(f"mutable module state          {len(state)}")
    if args.list:
        print("\n".join(["", "files:", *big, "", "functions:",
                         *[f"{n} ({k}{', reason stated' if w else ''})" for n, k, w in funcs],
                         "", "module state:", *state, "", "largest classes:",
                         *[f"{c} ({n})" for n, c in classes[:8]]]))


if __name__ == "__main__":
    main()
