"""Pipeline split: layer blocks of a traced graph, and stage programs cut from a rank's program.

`layer_blocks` coarsens the traced graph into the chain of blocks the stage solver cuts: the
model's repeated layers, found from the module hierarchy torch.export records on every node
(`nn_module_stack`): the container with the most numbered children (`h.0`, `h.1`, ... or
`model.layers.0`, ...) gives one block per child, plus what runs before the first layer
(embeddings) and after the last (final norm, head, loss). A model without numbered children is
cut between the root's own submodules.

`split_stages` cuts the local program a rank runs (passes.rewrite's output, its FSDP buckets
within stages, so that each stage gathers and prefetches its own parameters) into one FX
program per pipeline stage, reading what each node is from the record the rewrite left on
it (`passes.emitted`).
Every value a later stage needs is sent to the next stage and passed on from stage to stage
until its last use (skip connections cross any number of cuts); values computed only from
constants (positions, rotary tables, masks) are recomputed in each stage instead; user inputs
reach every stage directly. An op writing into a buffer runs in its own stage only
(`buffer_writes` finds them: the runtime sends the buffer's new value to the other pp ranks).

In the pipeline's story this is the cutting: planned in autopar/pipeline_plan.py (which reads
`layer_blocks`), built into a rank's stages in autopar/pipeline.py, run by runtime/pipeline.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .emitted import Emitted, emitted
from .graph_queries import state_writes
from .strategies import CONSTANT, OP, StrategyGraph
from .trace import TracedProgram


@dataclass
class LayerBlocks:
    """The chain of blocks: display names, and the block of every op and constant node."""

    names: list[str]
    of_node: dict[str, int]

    def stage_of(self, cuts, num_stages: int) -> dict[str, int]:
        """The stage of every node when stage k starts at block cuts[k - 1] (stage 0 at 0)."""
        first = [0, *cuts]
        return {n: max(k for k in range(num_stages) if first[k] <= b)
                for n, b in self.of_node.items()}


def layer_count(program: TracedProgram) -> int:
    """How many layers `program`'s model repeats (the layer blocks `layer_blocks` makes,
    without the blocks before and after them): the children of its largest numbered
    container (a ModuleList), else the root's own submodules."""
    names = {n.name for n in program.graph.nodes if n.op == "call_function"}
    return len(_layers(program, names)[2])


def _layers(program: TracedProgram, names) -> tuple[list[str], dict, list[str]]:
    """The call nodes of `program` among `names` in order, each one's module stack, and the
    module paths of the model's layers, in order of first use."""
    prefix = program.module_prefix
    order = [n.name for n in program.graph.nodes
             if n.op == "call_function" and n.name in names]
    stacks = {}
    for node in program.graph.nodes:
        if node.name in names and node.op == "call_function":
            stack = node.meta.get("nn_module_stack") or {}
            stacks[node.name] = [v[0] for v in stack.values()]
    children: dict[str, list[str]] = {}
    for name in order:
        for path in stacks[name]:
            parent, _, last = path.rpartition(".")
            if last.isdigit() and path not in children.setdefault(parent, []):
                children[parent].append(path)
    container = max(children, key=lambda p: (len(children[p]), -p.count(".")), default=None)
    if container is None or len(children[container]) < 2:
        # No numbered layers: the root's own submodules, in order of first use.
        root = prefix.rstrip(".")
        container, layers = root, []
        for name in order:
            for path in stacks[name]:
                parent = path.rpartition(".")[0] if "." in path else ""
                if parent == root and path != root and path not in layers:
                    layers.append(path)
        children[container] = layers
    return order, stacks, children[container]


def layer_blocks(program: TracedProgram, graph: StrategyGraph) -> LayerBlocks:
    """Coarsen `graph` (the strategy graph of `program`) into a chain of layer blocks."""
    prefix = program.module_prefix
    order, stacks, layers = _layers(program, graph.nodes)
    position = {path: i for i, path in enumerate(layers)}
    layer_of: dict[str, int | None] = {}
    for name in order:
        layer_of[name] = next((position[p] for p in stacks[name] if p in position), None)
    inside = [i for i, name in enumerate(order) if layer_of[name] is not None]
    first, last = (inside[0], inside[-1]) if inside else (len(order), -1)
    raw: dict[str, int] = {}
    running = 0
    for i, name in enumerate(order):
        if layer_of[name] is not None:
            running = max(running, layer_of[name] + 1)
            raw[name] = running
        elif i < first:
            raw[name] = 0
        elif i > last:
            raw[name] = len(layers) + 1
        else:
            raw[name] = running
    short = [p.removeprefix(prefix) for p in layers]
    names = [f"before {short[0]}" if short else "model", *short,
             f"after {short[-1]}" if short else "end"]
    # Keep blocks that compute something (op nodes); constants follow the next kept block.
    kept = sorted({raw[n] for n in order if graph.nodes[n].kind == OP})
    renumber = {b: i for i, b in enumerate(kept)}
    of_node = {}
    for name in order:
        b = raw[name]
        nxt = next((k for k in kept if k >= b), kept[-1] if kept else 0)
        of_node[name] = renumber.get(nxt, 0)
    return LayerBlocks([names[b] for b in kept] or ["model"], of_node)


@dataclass
class ValueMeta:
    """Local shape, dtype and whether a gradient flows back, of a value sent between stages."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def empty(self, device="meta") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device,
                           requires_grad=self.requires_grad)


@dataclass
class StageProgram:
    """One stage's program: (*received, *inputs, *params, *constants) -> the values it sends
    to the next stage (a tuple), or, for the last stage, the split program's own outputs
    (`sent` then describes those)."""

    index: int
    module: fx.GraphModule
    received: list[ValueMeta]
    sent: list[ValueMeta]
    inputs: list[str]        # user-input placeholders it reads, in call order
    params: list[str]        # parameter placeholders
    constants: list[str]     # buffer and constant placeholders


class SplitError(RuntimeError):
    """The rank's program does not follow the stage order (an internal error)."""


def split_stages(gm: fx.GraphModule, graph: StrategyGraph, stage_of: dict[str, int],
                 kinds: dict[str, str], num_stages: int) -> list[StageProgram]:
    """Cut `gm` (a local program from passes.rewrite for `graph`, its FSDP buckets within
    stages: rewrite's `stage_of`) into `num_stages` programs. `stage_of` gives
    the stage of every op node of `graph`; `kinds` the kind of every placeholder (param |
    constant | input). A bucket's gathers run in the stage that uses it: its all-gather
    starts at the top of the stage's program, or where the stage waits for the bucket before
    it (prefetch within the stage, as in the whole program)."""
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    record = {n: emitted(n) for n in nodes if n.op != "output"}
    origin = {n: r.origin if r.role == "op" else None for n, r in record.items()}
    const = _rebuilt(gm, nodes, origin, graph)
    stage = _stage_of_nodes(nodes, origin, record, const, stage_of, num_stages)
    live = _crossing(nodes, output, stage, num_stages)

    def meta(n: fx.Node) -> ValueMeta:
        return _value_meta(n, record[n])

    out = []
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for s in range(num_stages):
        body = [n for n in nodes if stage.get(n) == s]
        roots = body + ([output] if s == num_stages - 1 else [])
        sent = live[s] if s < num_stages - 1 else []
        need: set[fx.Node] = set()
        todo = [i for n in roots for i in n.all_input_nodes] + list(sent)
        while todo:
            i = todo.pop()
            if i in need:
                continue
            need.add(i)
            if i in const and i.op != "placeholder":
                todo.extend(i.all_input_nodes)  # rebuilt in this stage
        received = live[s - 1] if s > 0 else []
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for k, v in enumerate(received):
            env[v] = g.placeholder(f"received_{k}")
        used = {kind: [p for p in placeholders if p in need and kinds[p.name] == kind]
                for kind in ("input", "param", "constant")}
        for kind in ("input", "param", "constant"):
            for p in used[kind]:
                env[p] = g.placeholder(p.name)
        for n in nodes:
            if n in body or (n in const and n in need and n.op != "placeholder"):
                env[n] = g.node_copy(n, env.__getitem__)
        if s < num_stages - 1:
            g.output(tuple(env[v] for v in sent))
        else:
            g.output(fx.map_arg(output.args[0], env.__getitem__))
        module = fx.GraphModule(torch.nn.Module(), g)
        module.recompile()
        if s == num_stages - 1:  # what the program returns, flattened
            sent = _flat_nodes(output.args[0])
        out.append(StageProgram(s, module, [meta(v) for v in received],
                                [meta(v) for v in sent], [p.name for p in used["input"]],
                                [p.name for p in used["param"]],
                                [p.name for p in used["constant"]]))
    return out


def _rebuilt(gm: fx.GraphModule, nodes: list[fx.Node], origin: dict,
             graph: StrategyGraph) -> set[fx.Node]:
    """The values any stage can compute for itself: placeholders (every stage has the user
    inputs, its own parameter shards and the constants), what is computed from constants
    alone, and the resharding of placeholders (a parameter's all-gather, or its bucket's start
    and wait, runs in each stage using it)."""
    # An op writing into a buffer (BatchNorm's num_batches_tracked += 1) runs once, in its own
    # stage, even when it reads constants alone: recomputed where needed, it would never run.
    writes = set(state_writes(gm))
    const: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            const.add(n)
        elif n.op == "call_function" and n.name not in writes:
            ins = n.all_input_nodes
            if origin[n] is not None:
                if graph.nodes[origin[n]].kind == CONSTANT:
                    const.add(n)
            elif ins and all(i in const for i in ins):
                const.add(n)
    return const


def _stage_of_nodes(nodes: list[fx.Node], origin: dict, record: dict, const: set,
                    stage_of: dict[str, int], num_stages: int) -> dict[fx.Node, int]:
    """The stage of every computed node: its traced node's; a getitem its tuple's; a
    resharding step the stage of the op it was emitted for (the next traced node)."""
    stage: dict[fx.Node, int] = {}
    pending: list[fx.Node] = []
    for n in nodes:
        if n.op != "call_function" or n in const:
            continue
        if origin[n] is not None:
            stage[n] = stage_of[origin[n]]
            for q in pending:
                stage[q] = stage[n]
            pending = []
        elif record[n].role == "getitem" and n.args[0] in stage:
            stage[n] = stage[n.args[0]]
        else:
            pending.append(n)
    for q in pending:
        stage[q] = num_stages - 1
    return stage


def _crossing(nodes: list[fx.Node], output: fx.Node, stage: dict[fx.Node, int],
              num_stages: int) -> list[list[fx.Node]]:
    """For each cut k (after stage k), the values it carries: computed in stage k or before
    and used after it."""
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if n in stage or n is output:
            s = stage.get(n, num_stages - 1)
            for i in n.all_input_nodes:
                if i in stage:
                    if stage[i] > s:
                        raise SplitError(f"{n.name} (stage {s}) uses {i.name} from the later "
                                         f"stage {stage[i]}")
                    last_use[i] = max(last_use.get(i, stage[i]), s)
    return [[v for v in nodes if v in stage and stage[v] <= k < last_use.get(v, -1)]
            for k in range(num_stages - 1)]


def _flat_nodes(tree) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.map_arg(tree, out.append)
    return out


def _value_meta(n: fx.Node, record: Emitted) -> ValueMeta:
    """The local value `n` sends to the next stage, as the rewrite recorded it."""
    if record.shape is None:
        raise SplitError(f"{n.name} ({record.role} of {record.origin}) would cross a stage "
                         "boundary, but it is not one tensor")
    return ValueMeta(record.shape, record.dtype, record.requires_grad)


def buffer_writes(stages: list[StageProgram]) -> dict[str, set[int]]:
    """The buffer placeholders the stage programs write into in forward (BatchNorm's running
    statistics, a router's token counts), with the stages that write each."""
    out: dict[str, set[int]] = {}
    for prog in stages:
        for written in state_writes(prog.module).values():
            for ph in written & set(prog.constants):
                out.setdefault(ph, set()).add(prog.index)
    return out
