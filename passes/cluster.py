"""Cluster the strategy graph so the ILP stays small: who decides each node's strategy.

Every node is assigned an *owner* (a node that carries ILP variables) and a map from the owner's
strategy index to its own. Two reductions produce owners other than the node itself:

- Followers: a node whose non-constant inputs are all decided by one owner, and whose strategy
  is fixed by one input's placement (views, unary ops, elementwise ops on values of one
  origin, such as rotary embeddings), takes the strategy that consumes that placement
  unchanged, so the edge never reshards. A parameter's own uses never follow it: where it is
  stored and how it is used are separate decisions (FSDP gathers it for every use).
- Repeated layers: the blocks of a ModuleList (transformer layers) whose nodes match one for one
  (same ops, shapes and wiring) share the first block's choices; the ILP prices one block with
  each cost multiplied by the number of blocks. Only blocks with at least two matrix products
  are folded: a block can then pair column- and row-parallel products inside itself, whereas
  single-product blocks (a Sequential of Linears) need alternating choices.

Both restrict the search the way Alpa and AutoParallel do; the assignment is expanded back to
every node after solving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .strategies import CONSTANT, OP, PARAM, StrategyGraph


@dataclass
class Clustering:
    """owner[v] decides node v; v's strategy is v.strategies[index[v][k]] when the owner picks
    its strategy k."""

    owner: dict[str, str]
    index: dict[str, list[int]]
    layers: list[list[str]] = field(default_factory=list)  # folded blocks, first is the model
    twin: dict[str, str] = field(default_factory=dict)     # folded node -> its first-block twin

    def owners(self) -> list[str]:
        """Nodes that carry variables, in graph order."""
        return list(dict.fromkeys(self.owner.values()))

    def twin_of(self, v: str) -> str:
        """The node whose costs v shares (its first-block twin, or itself)."""
        return self.twin.get(v, v)

    def expand(self, owner_choice: dict[str, int]) -> dict[str, int]:
        """Every node's strategy index from the owners' choices."""
        return {v: self.index[v][owner_choice[o]] for v, o in self.owner.items()}


def identity(graph: StrategyGraph) -> Clustering:
    """No clustering: every node decides for itself."""
    return Clustering({v: v for v in graph.nodes},
                      {v: list(range(len(n.strategies))) for v, n in graph.nodes.items()})


def cluster(graph: StrategyGraph, gm: fx.GraphModule | None = None,
            fold_layers: bool = True, merge_followers: bool = True) -> Clustering:
    """Owners for every node of `graph` (see the module docstring)."""
    c = identity(graph)
    if fold_layers and gm is not None:
        _fold_layers(graph, gm, c)
    if merge_followers:
        _merge_followers(graph, c)
    return c


def _merge_followers(graph: StrategyGraph, c: Clustering) -> None:
    for v in graph.nodes.values():
        if v.kind != OP or c.owner[v.name] != v.name:
            continue
        free = [(slot, u, idx) for slot, (u, idx) in enumerate(v.inputs)
                if graph.nodes[u].kind != CONSTANT]
        if len({c.owner[u] for _, u, _ in free}) != 1:
            continue  # inputs decided apart: following one would force reshards on the others
        if graph.nodes[c.owner[free[0][1]]].kind == PARAM:
            # A parameter's storage is decided apart from its uses: FSDP stores it sharded
            # and gathers it for the op (a cast or slice of the weight, say).
            continue
        for slot, u, idx in free:
            mapping = _follow_map(graph, c, v, slot, u, idx)
            if mapping is None:
                continue
            new_owner = c.owner[u]
            for w, o in list(c.owner.items()):  # v and the nodes v decided (folded copies)
                if o == v.name:
                    c.owner[w] = new_owner
                    c.index[w] = [c.index[w][m] for m in mapping]
            break


def _follow_map(graph: StrategyGraph, c: Clustering, v, slot: int, u: str, idx):
    """v's strategy for each strategy of u's owner, if u's placement on this input always
    selects exactly one strategy of v; else None."""
    by_input: dict = {}
    for j, s in enumerate(v.strategies):
        by_input.setdefault(s.inputs[slot], []).append(j)
    producer = graph.nodes[u]
    mapping = []
    for k in c.index[u]:
        js = by_input.get(producer.strategies[k].out(idx), [])
        if len(js) != 1:
            return None
        mapping.append(js[0])
    return mapping


def _block_of(node: fx.Node, containers: set[str]) -> tuple[str, int] | None:
    """(container path, block index) of the innermost ModuleList block the node belongs to."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in reversed(list(stack.values())):
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix, last = ".".join(parts[:cut]), parts[cut]
            if last.isdigit() and prefix in containers:
                return prefix, int(last)
    return None


def _fold_layers(graph: StrategyGraph, gm: fx.GraphModule, c: Clustering) -> None:
    """Tie the nodes of identical ModuleList blocks to the first block's."""
    containers = _module_lists(gm)
    blocks: dict[tuple[str, int], list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in graph.nodes:
            continue
        key = _block_of(node, containers)
        if key is not None:
            blocks.setdefault(key, []).append(node.name)
    # parameters belong to the block of their users
    block_of = {n: key for key, names in blocks.items() for n in names}
    users: dict[str, set] = {}
    for n, key in block_of.items():
        for u, _ in graph.nodes[n].inputs:
            if graph.nodes[u].kind == PARAM:
                users.setdefault(u, set()).add(key)
    for v in graph.nodes.values():
        if v.kind == PARAM and len(users.get(v.name, ())) == 1:
            blocks[next(iter(users[v.name]))].insert(0, v.name)
    by_container: dict[str, dict[int, list[str]]] = {}
    for (prefix, i), names in blocks.items():
        by_container.setdefault(prefix, {})[i] = names
    for members in by_container.values():
        if min(_products(graph, names) for names in members.values()) < 2:
            continue  # single-product blocks (Sequential of Linears) alternate column and row
        order = sorted(members)
        first = members[order[0]]
        for i in order[1:]:
            names = members[i]
            if _same_shape(graph, first, names):
                for a, b in zip(first, names):
                    c.owner[b] = a
                    c.index[b] = list(range(len(graph.nodes[b].strategies)))
                    c.twin[b] = a
        c.layers.append([members[i][0] for i in order])


def _products(graph: StrategyGraph, names: list[str]) -> int:
    return sum(graph.nodes[n].facts.product is not None for n in names)


def _same_shape(graph: StrategyGraph, a: list[str], b: list[str]) -> bool:
    """Blocks match node for node: ops, shapes, candidate strategies, and wiring (inputs from
    inside the block at the same positions; from outside, anything)."""
    if len(a) != len(b):
        return False
    pos_a = {n: i for i, n in enumerate(a)}
    pos_b = {n: i for i, n in enumerate(b)}
    for x, y in zip(a, b):
        nx, ny = graph.nodes[x], graph.nodes[y]
        if (nx.kind, nx.op, nx.in_shapes, nx.out_shapes, nx.strategies) != \
                (ny.kind, ny.op, ny.in_shapes, ny.out_shapes, ny.strategies):
            return False
        for (ux, ix), (uy, iy) in zip(nx.inputs, ny.inputs):
            if ix != iy or (ux in pos_a) != (uy in pos_b):
                return False
            if ux in pos_a and pos_a[ux] != pos_b[uy]:
                return False
    return True


def _module_lists(gm: fx.GraphModule) -> set[str]:
    """Paths of containers whose children are numbered (ModuleList / Sequential blocks): any
    path prefix that appears followed by several different integer components."""
    seen: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            for cut in range(1, len(parts)):
                if parts[cut].isdigit():
                    seen.setdefault(".".join(parts[:cut]), set()).add(int(parts[cut]))
    return {p for p, idx in seen.items() if len(idx) > 1}
