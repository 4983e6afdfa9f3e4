"""The printed plan: a table of the model's modules, identical layers folded, or one row per op.

`modules(plan)` is what `print(plan)` shows: one row per module of the model (the FX node's
`nn_module_stack`, recorded on every op as `OpEntry.module`), the blocks of a layer container
(`layers.0`, `layers.1`, ...) that are planned alike folded into one block shown once with
"x32", then the collectives per step and the cost. `ops(plan)` is the table of every op.
Both take an `autopar.Plan` (duck-typed here, so that the Plan's module may import this one).
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field

from autopar.passes.placement import fmt

WIDTH = 120
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A",
         "p2p": "P2P", "gradient_sync": "grad"}
# OpEntry.replicated reasons, as the table's note shows them (explain gives them whole)
NOTE = {"no sharding rule": "no rule", "replicated is cheaper": "cheaper",
        "no sharded strategy divides its shapes by the mesh": "indivisible",
        "updates state in place": "writes state",
        "its rule shards no input for these arguments": "rule replicates"}


def ms(t: float) -> str:
    """Seconds as milliseconds, three decimals."""
    return f"{t * 1e3:.3f}"


def mib(b: float) -> str:
    """Bytes as MiB, one decimal."""
    return f"{b / 2**20:.1f}"


def header(plan) -> list[str]:
    """The plan's first lines: mesh, hash, solver, options, and the placement notation."""
    names = ",".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))
    dims = ", ".join(plan.mesh.names[k] for k in plan.placement_dims)
    return [f"autopar plan  mesh ({names}) on {plan.mesh.hardware}  hash {plan.hash()}",
            f"solved by {plan.solver} in {plan.solve_time:.2f} s; options: "
            f"{plan.options.summary()}",
            f"placements: one entry per mesh dimension ({dims}): R replicated, S(d) sharded on "
            "tensor dim d, P pending sum",
            "collectives: AG all-gather, RS reduce-scatter, AR all-reduce, A2A all-to-all, "
            "[dim] mesh dimension, g: gradient sync"]


# -- the module view -------------------------------------------------------------------------

@dataclass
class ModuleRow:
    """What one module does in one layer (or once, outside the layers)."""

    params: list[str] = field(default_factory=list)      # storage placements, in order
    ops: list = field(default_factory=list)              # OpEntry
    collectives: list = field(default_factory=list)      # Collective
    names: list[str] = field(default_factory=list)       # its parameters, in `params`' order

    def signature(self) -> tuple:
        return (tuple(self.params),
                tuple((o.op, tuple(o.inputs), str(o.output), o.stage, o.replicated)
                      for o in self.ops))


def layer_container(paths: list[str]) -> str | None:
    """The module whose numbered children hold the most ops' modules (`model.layers` of
    `model.layers.3.mlp`), or None when no module has two numbered children."""
    children: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for cut in range(1, len(parts)):
            if parts[cut].isdigit():
                children.setdefault(".".join(parts[:cut]), set()).add(parts[cut])
    best = max(children, key=lambda p: (len(children[p]), -p.count(".")), default=None)
    return best if best is not None and len(children[best]) > 1 else None


def _split(path: str, container: str | None) -> tuple[int | None, str]:
    """(layer index, path inside the layer) of a module, or (None, path) outside the layers."""
    if container is not None and path.startswith(container + "."):
        index, _, rest = path[len(container) + 1:].partition(".")
        if index.isdigit():
            return int(index), rest
    return None, path


@dataclass
class ModuleGroup:
    """One block of the module view: a module outside the layers (`count` 1, one row labelled
    "") or a run of consecutive layers planned alike (`label` "h.0-11", `count` 12, one row per
    module inside a layer, keyed by its path inside the layer)."""

    label: str
    count: int
    rows: dict[str, ModuleRow]
    layer: bool = False

    @property
    def time(self) -> float:
        """Seconds of all its ops (forward + backward), every folded layer counted."""
        return sum(o.time for r in self.rows.values() for o in r.ops) * self.count


def module_groups(plan) -> list[ModuleGroup]:
    """The plan's ops, parameters and collectives by the model's modules (their
    `nn_module_stack` path), in graph order, identical consecutive layers folded into one."""
    container = layer_container([o.module for o in plan.ops])
    rows: dict[tuple[int | None, str], ModuleRow] = {}
    for o in plan.ops:
        rows.setdefault(_split(o.module, container), ModuleRow()).ops.append(o)
    owner = {o.name: _split(o.module, container) for o in plan.ops}
    for name, p in plan.parameters.items():
        key = _split(name.rpartition(".")[0], container)
        row = rows.setdefault(key, ModuleRow())
        row.params.append(fmt(p))
        row.names.append(name)
        owner[name] = key
    for c in plan.collectives:
        if c.at in owner:
            rows[owner[c.at]].collectives.append(c)
    layers: dict[int, dict[str, ModuleRow]] = {}
    for (layer, rel), row in rows.items():
        if layer is not None:
            layers.setdefault(layer, {})[rel] = row
    groups: list[ModuleGroup] = []
    done: set[int] = set()
    for (layer, rel), row in rows.items():
        if layer is None:
            groups.append(ModuleGroup(rel or "(model)", 1, {"": row}))
        elif layer not in done:
            run = _run(layers, layer)
            done.update(run)
            label = f"{container}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else "")
            groups.append(ModuleGroup(label, len(run), layers[layer], layer=True))
    return groups


def modules(plan) -> str:
    """The plan grouped by the model's modules, identical layers folded (what print shows)."""
    table = [("module", "params", "heaviest op: inputs -> output", "ms", "collectives",
              "Rn: n replicated")]
    for group in module_groups(plan):
        if not group.layer:
            table.append(cells(plan, group.label, group.rows[""]))
            continue
        count = group.count
        stage = {o.stage for r in group.rows.values() for o in r.ops}
        # the group's row has no op of its own: the op column says what its ms counts
        where = [f"stage {min(stage)}"] if getattr(plan, "pipeline", None) else []
        where += ["ms: all; rows: 1 layer"] if count > 1 else []
        table.append((group.label + (f"  x{count}" if count > 1 else ""), "", "; ".join(where),
                      ms(group.time), "", ""))
        for r, sub in group.rows.items():
            table.append(cells(plan, "  " + (r or "(layer)"), sub))
    after = parameter_lines(plan) + [""] + collective_lines(plan) + [""]
    lines = _wrapped(header(plan)) + [""] + _columns(table) + [""]
    lines += _wrapped(after + cost_lines(plan.cost) + footer(plan))
    return "\n".join(lines)


def _run(layers: dict[int, dict[str, ModuleRow]], first: int) -> list[int]:
    """`first` and the layers after it planned exactly like it (consecutive indices)."""
    sig = {r: row.signature() for r, row in layers[first].items()}
    run = [first]
    while run[-1] + 1 in layers and \
            {r: row.signature() for r, row in layers[run[-1] + 1].items()} == sig:
        run.append(run[-1] + 1)
    return run


def cells(plan, label: str, row: ModuleRow) -> tuple[str, ...]:
    """A module's row of the table: label, its parameters' placements, its heaviest op with
    the placements of its inputs and output, ms, collectives, replicated ops and why."""
    names = plan.mesh.names
    params = ",".join(dict.fromkeys(row.params)) or "-"
    heavy = max(row.ops, key=lambda o: o.time, default=None)
    op = ""
    if heavy is not None:
        out = heavy.output if isinstance(heavy.output, str) else ",".join(heavy.output)
        op = f"{short_op(heavy.op)}: {' '.join(heavy.inputs)} -> {out}"
    kinds = Counter(f"{SHORT.get(c.kind, c.kind)}[{names[c.mesh_dim]}]"
                    for c in row.collectives if c.phase == "forward")
    grads = Counter(f"{SHORT.get(c.kind, c.kind)}[{names[c.mesh_dim]}]"
                    for c in row.collectives if c.phase == "gradient sync")
    coll = " ".join(k + (f"x{n}" if n > 1 else "") for k, n in kinds.items())
    if grads:
        coll += (" " if coll else "") + "g:" + " ".join(grads)
    notes = Counter(NOTE.get(o.replicated, o.replicated) for o in row.ops if o.replicated)
    note = f"R{sum(notes.values())} " + ",".join(notes) if notes else ""
    return (label, params, op, ms(sum(o.time for o in row.ops)), coll, note)


# Column caps: module, params, op, ms, collectives. A wider cell wraps; the note (the last
# column) takes what is left of WIDTH, at least its header's width, the op column giving way.
CAPS = (30, 12, 36, 10, 20)


def _columns(table: list[tuple[str, ...]]) -> list[str]:
    """Aligned rows no wider than WIDTH. A cell wider than its column wraps onto continuation
    lines, indented two spaces, the row's other cells blank on them: nothing is cut."""
    widths = [min(cap, max(len(r[i]) for r in table)) for i, cap in enumerate(CAPS)]
    room = WIDTH - sum(widths) - 2 * len(widths)
    least = len(table[0][-1])
    widths[2] -= max(0, least - room)
    widths.append(min(max(len(r[-1]) for r in table), max(room, least)))
    out = []
    for r in table:
        parts = [_wrap(c, w) for c, w in zip(r, widths)]
        for k in range(max(map(len, parts))):
            line = [p[k] if k < len(p) else "" for p in parts]
            line = [c.rjust(w) if i == 3 and k == 0 and r is not table[0] else c.ljust(w)
                    for i, (c, w) in enumerate(zip(line, widths))]
            out.append("  ".join(line).rstrip())
    return out


class _Wrapper(textwrap.TextWrapper):
    # Breaks at spaces and after the dots of module paths and the commas of placement lists;
    # a word is split only when it is wider than its column.
    wordsep_simple_re = re.compile(r"(\s+|(?<=[.,])(?=[^\s.,]))")


def _wrap(cell: str, width: int) -> list[str]:
    """A cell's lines in a column `width` wide, continuations two spaces further in."""
    if len(cell) <= width:
        return [cell]
    indent = " " * (len(cell) - len(cell.lstrip()) + 2)
    return _Wrapper(width, subsequent_indent=indent, break_on_hyphens=False).wrap(cell)


def _wrapped(lines: list[str]) -> list[str]:
    """Lines longer than WIDTH wrapped, continuations indented four spaces."""
    return [part for line in lines
            for part in textwrap.wrap(line, WIDTH, subsequent_indent="    ") or [""]]


def short_op(op: str) -> str:
    """An ATen op's name as the table shows it: no overload, no leading underscore, the
    attention kernels as "sdpa"."""
    name = op.split(".")[0].lstrip("_")
    return "sdpa" if name.startswith("scaled_dot_product") else name


def storage_label(plan, name: str) -> str:
    """Parameter `name`'s storage placement, with its ZeRO stage when it has one."""
    stage = plan.zero.get(name)
    return fmt(plan.parameters[name]) + (f" ZeRO-{stage}" if stage else "")


def parameter_lines(plan, groups: int = 4) -> list[str]:
    """Parameters by storage placement: count, and the first names of each."""
    by: dict[str, list[str]] = {}
    for name in plan.parameters:
        by.setdefault(storage_label(plan, name), []).append(name)
    lines = [f"parameters (storage placement): {len(plan.parameters)} tensors"]
    ranked = sorted(by.items(), key=lambda kv: -len(kv[1]))
    for p, ns in ranked[:groups]:
        shown = ", ".join(ns[:2]) + (f", ... ({len(ns)} in all)" if len(ns) > 2 else "")
        lines.append(f"  {p}: {shown}")
    if len(ranked) > groups:
        lines.append(f"  ... {len(ranked) - groups} other placements "
                     "(plan.table(detail=\"ops\") lists every op)")
    return lines


def collective_lines(plan) -> list[str]:
    """Collectives per step, by phase and kind: how many, bytes, seconds."""
    kinds: dict[tuple[str, str], list] = {}
    for c in plan.collectives:
        kinds.setdefault((c.phase, c.kind), []).append(c)
    lines = ["collectives per step:"]
    for (phase, kind), cs in sorted(kinds.items()):
        lines.append(f"  {phase:13s} {kind:15s} x{len(cs):<4d} {mib(sum(c.bytes for c in cs))}"
                     f" MiB  {ms(sum(c.time for c in cs))} ms")
    return lines


# Inside pipeline stages, ZeRO is FSDP keeping its parameters gathered across a step's
# microbatches (FSDP2 under torch.distributed.pipelining: no resharding after backward and no
# gradient sync until the last microbatch; ZeRO-2's reduce-scatter each microbatch is FSDP2
# syncing gradients every microbatch), where FSDP proper gathers them again every microbatch.
_KEPT_ACROSS = {
    1: "; in the stages, FSDP kept gathered across the step's microbatches: each parameter "
       "gathered once a step and its gradient reduce-scattered once, after the last "
       "microbatch",
    2: "; in the stages, FSDP kept gathered across the step's microbatches: each parameter "
       "gathered once a step, its gradient reduce-scattered every microbatch",
}


def footer(plan) -> list[str]:
    """What follows the cost: unsupported ops, the meshes tried, recomputation, accumulation,
    randomness, pipeline."""
    lines = []
    if plan.unsupported_ops:
        lines.append(f"replicated (no sharding rule): {', '.join(plan.unsupported_ops)}")
    if plan.mesh_search:
        lines += ["", "meshes tried (fastest first):"]
        for row in plan.mesh_search[:10]:
            shape = "x".join(map(str, row["shape"])) + " " + ",".join(row["names"])
            got = (f"{ms(row['step_time'])} ms, {mib(row['peak_memory'])} MiB"
                   if row["step_time"] is not None else f"no plan: {row['why'][:70]}")
            lines.append(f"  {shape:24s} {got}")
    lines += recompute_lines(plan.recompute)
    if plan.resharded:
        n = len(plan.resharded)
        lines.append(f"reshard after forward: {n} FSDP parameter{'s' * (n != 1)} freed after "
                     "forward, gathered again for backward; the others stay gathered")
    for stage in sorted(set(plan.zero.values())):
        n = sum(1 for v in plan.zero.values() if v == stage)
        what = "optimizer state" if stage == 1 else "optimizer state and gradients"
        lines.append(f"ZeRO-{stage}: {n} replicated parameter{'s' * (n != 1)} with {what} "
                     "sharded over the data-parallel ranks (stepped shards all-gathered)"
                     + (_KEPT_ACROSS[stage] if plan.pipeline is not None else ""))
    if plan.accumulation > 1:
        lines.append(f"gradient accumulation: {plan.accumulation} microbatches a step, "
                     "gradients synchronized once (the graph above is one microbatch)")
    if plan.randomness == "counter":
        lines.append("randomness: counter (each rank computes its block of every random op "
                     "from the step's key: the same numbers under every plan)")
    elif plan.randomness:
        lines.append("randomness: eager (every rank draws each random op whole: bit for bit "
                     "eager PyTorch on one device)")
    if plan.pipeline is not None:
        lines += ["", *plan.pipeline.lines()]
    return lines


def recompute_lines(r) -> list[str]:
    """Which blocks recompute their activations in backward, and how (`r`: a Recompute)."""
    out = []
    if r.mode_of:
        names = list(r.blocks)
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"
        modes = "/".join(sorted(set(r.mode_of.values())))
        out.append(f"recomputation: {modes} in {len(names)} block{'s' * (len(names) != 1)} "
                   f"({shown}), {len(r.mode_of)} ops")
    if r.user:
        shown = ", ".join(r.user[:4]) + (" ..." if len(r.user) > 4 else "")
        out.append(f"the model's torch.utils.checkpoint regions ({shown}) "
                   + ("recompute in full" if r.user_kept else
                      "do not recompute: the plan (recompute=\"none\") decided otherwise"))
    return out


# -- the op view -----------------------------------------------------------------------------

def ops(plan) -> str:
    """The plan as one row per op group, with collectives and the cost summary."""
    lines = header(plan) + [""]
    by_node: dict[str, list] = {}
    for c in plan.collectives:
        by_node.setdefault(c.at, []).append(c)
    rows = [("op group", "aten op", "inputs", "output", "ms", "collectives", "replicated")]
    for o in plan.ops:
        out = o.output if isinstance(o.output, str) else "(" + ",".join(o.output) + ")"
        coll = " ".join(f"{c.kind}[{plan.mesh.names[c.mesh_dim]}]"
                        for c in by_node.get(o.name, []) if c.phase == "forward")
        rows.append((o.name, o.op, " ".join(o.inputs), out, ms(o.time), coll,
                     NOTE.get(o.replicated, o.replicated)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    lines.append("parameters (storage placement):")
    groups: dict[str, list[str]] = {}
    for name in plan.parameters:
        groups.setdefault(storage_label(plan, name), []).append(name)
    for p, ns in groups.items():
        shown = ", ".join(ns[:4]) + (f", ... ({len(ns)} in all)" if len(ns) > 4 else "")
        lines.append(f"  {p}: {shown}")
    lines.append("")
    lines += collective_lines(plan) + [""] + cost_lines(plan.cost) + footer(plan)
    return "\n".join(lines)


def cost_lines(cost) -> list[str]:
    """The cost summary (a PlanCost): step time split into compute and each collective kind,
    memory per device split by kind, against the budget."""
    comm = ", ".join(f"{k} {ms(v)}" for k, v in sorted(cost.communication.items()) if v)
    split = f"forward {ms(cost.compute_forward)}, backward " \
        f"{ms(cost.compute - cost.compute_forward)}; " if cost.compute_forward else ""
    hidden = sum(getattr(cost, "hidden", {}).values())
    exposed = f" - {ms(hidden)} ms of it hidden under compute" if hidden else ""
    out = [f"predicted step {ms(cost.step_time)} ms = compute {ms(cost.compute)} ms "
           f"({split}{cost.compute_source}) + communication {ms(cost.communication_total)} ms "
           f"({comm or 'none'}){exposed}"]
    mem = ", ".join(f"{k} {mib(v)}" for k, v in cost.memory.items())
    budget = f" of {mib(cost.memory_budget)} MiB budget" if cost.memory_budget else ""
    out.append(f"memory per device {mib(cost.peak_memory)} MiB{budget} ({mem}); "
               f"{cost.precision}, {cost.optimizer}")
    return out
