"""`plan.explain(name)`: why an op, a parameter or a module runs as the plan says.

Reads what the planner recorded in `Plan.alternatives` (solver/alternatives.py): for each op
and parameter, the chosen strategy and the next best candidates with their cost split and
what ruled them out. Takes an `autopar.Plan` (duck-typed, so that the Plan's module may
import this one).
"""

from __future__ import annotations

import difflib
import re
import textwrap
from dataclasses import dataclass

from .table import SHORT, WIDTH, mib, ms

SHOWN = 6  # nodes a module's explanation shows (the heaviest ops, then its parameters)


@dataclass
class Explanation:
    """What `plan.explain` returns: the nodes it covers and their candidates (plain data);
    prints as text."""

    name: str
    nodes: dict[str, list[dict]]
    text: str

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


def nodes_named(plan, name: str) -> list[str]:
    """The ops and parameters `name` designates: an op group, a parameter, or every op and
    parameter of a module (its path in full, or a suffix of it such as "layers.0.mlp");
    raises KeyError with the closest names when none matches."""
    ops = {o.name: o for o in plan.ops}
    if name in ops or name in plan.parameters:
        return [name]
    for match in (lambda m: m == name or m.startswith(name + "."),
                  lambda m: m.endswith("." + name) or ("." + name + ".") in m):
        found = [o.name for o in sorted(plan.ops, key=lambda o: -o.time) if match(o.module)]
        found += [p for p in plan.parameters if match(p.rpartition(".")[0])]
        if found:
            return found
    known = [*ops, *plan.parameters, *{o.module for o in plan.ops}]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    raise KeyError(f"the plan has no op, parameter or module named {name!r}"
                   + (f"; did you mean {', '.join(close)}?" if close else
                      "; op names are in plan.table(detail='ops'), modules in print(plan)"))


def explain(plan, name: str) -> Explanation:
    """The chosen strategy of `name` (an op, parameter or module) and the next best
    alternatives, with their compute, collectives and memory, and what ruled each out."""
    names = nodes_named(plan, name)
    if not plan.alternatives:
        return Explanation(name, {}, f"{name}: this plan records no alternatives (a plan "
                           "drawn at random, given, pipelined, or saved by an older autopar)")
    index, tables = plan.alternatives["nodes"], plan.alternatives["tables"]
    known = [n for n in names if n in index]
    ops = {o.name: o for o in plan.ops}
    groups = alike(known, ops, tables, index)
    dims = ", ".join(plan.mesh.names)
    lines = [f"{name}: the chosen strategy and the next best, each priced with the rest of the "
             "plan fixed", f"(placements per mesh dimension {dims}; ms forward + backward; "
             "AG all-gather, RS reduce-scatter, A2A all-to-all, grad gradient sync; "
             "MiB per device; then what ruled it out)"]
    for group in groups[:SHOWN]:
        n, o = group[0], ops.get(group[0])
        what = (f"op {n} ({o.op}) in {o.module or 'the model'}" if o is not None
                else f"parameter {n} (storage placement)")
        if len(group) > 1:
            what += (f", and {len(group) - 1} more planned alike: "
                     + ", ".join(group[1:3]) + (", ..." if len(group) > 3 else ""))
        lines.append(what)
        for k, row in enumerate(tables[index[n]]):
            lines.append(_row(row, chosen=k == 0))
    rest = sum(len(g) for g in groups[SHOWN:])
    if rest:
        lines.append(f"... {rest} more ops and parameters in {name}: "
                     "explain one of them by name")
    text = "\n".join(part for line in lines
                     for part in textwrap.wrap(line, WIDTH, subsequent_indent=" " * 9,
                                               drop_whitespace=False) or [""])
    return Explanation(name, {n: tables[index[n]] for n in known}, text)


def alike(names: list[str], ops: dict, tables: list, index: dict) -> list[list[str]]:
    """`names` in groups planned alike (the same op, or a parameter, in the same module of
    another layer, such as `layers.3.mlp.up_proj` and `layers.4.mlp.up_proj`, with the same
    candidates at the same prices), each group in `names`' order, first seen first."""
    groups: dict[tuple, list[str]] = {}
    for n in names:
        o = ops.get(n)
        where = o.module if o is not None else n
        key = (o.op if o is not None else "parameter", re.sub(r"\.\d+(?=\.|$)", ".#", where),
               repr(tables[index[n]]))
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def _row(row: dict, chosen: bool) -> str:
    out = row["output"] if isinstance(row["output"], str) else ",".join(row["output"])
    placed = (" ".join(row["inputs"]) + " -> " if row["inputs"] else "") + out
    if row["total"] is None:
        return f"  {'chosen' if chosen else 'not':7s}{placed:34s} {row['ruled_out']}"
    comm = "".join(f" + {SHORT.get(k, k)} {ms(t)}"
                   for k, t in sorted(row["collectives"].items()) if t)
    cost = f"{ms(row['total'])} ms = compute {ms(row['compute'])}{comm}; {mib(row['memory'])} MiB"
    why = "" if chosen else f"; {row['ruled_out']}"
    return f"  {'chosen' if chosen else 'not':7s}{placed:30s} {cost}{why}"
