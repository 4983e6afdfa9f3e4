"""Trace a stack of identical layers once: export the model cut to its first two layers, then
copy the second layer's subgraph for every further layer.

torch.export runs every op of every layer through its tracer (most of planning time for deep
models: 8 s of 80-layer Llama-3 70B). A stack of N identical layers (`repeated_layers`: a
ModuleList or ModuleDict whose children share class, parameter and buffer names, shapes and
dtypes) computes layer i from layer i-1 the way layer 1 does from layer 0, unless its code
branches on the layer's index or on how many layers there are. So `check` first runs the whole
model forward on fake tensors (a tenth of export's time) and records every op per layer, with
each tensor argument named by where it comes from (an op of the same layer, of the previous
layer, of the code before the stack, this layer's own parameter, another named tensor); it
folds only when layers 1..N-1 record the same ops on the same arguments, nothing reads a
layer but the next one (and the code after the stack the last one), and the model cut to two
layers records the same code before the stack, the same two layers and the same code after.
Then `unfold` copies layer 1's exported nodes for layers 2..N-1 (new placeholders for their
parameters and buffers, module paths renamed), so the graph is the one export would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .torch_compat import tree_leaves

MIN_LAYERS = 4  # fewer layers save too little tracing to be worth the check


@dataclass
class Stack:
    """A stack of identical layers: the container's path in the traced root module and its
    children's names, in order."""

    path: str
    children: list[str]

    def layer(self, i: int) -> str:
        return f"{self.path}.{self.children[i]}"


def repeated_layers(root: nn.Module) -> Stack | None:
    """The largest ModuleList or ModuleDict of `root` with at least MIN_LAYERS children of one
    class whose parameters and buffers match by name, shape, dtype and requires_grad, and that
    share no tensor (tied layers are not copies); None when there is none."""
    best = None
    for path, module in root.named_modules():
        if not path or not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or \
                len(module) < MIN_LAYERS:
            continue
        children = list(module.items()) if isinstance(module, nn.ModuleDict) else \
            [(str(i), m) for i, m in enumerate(module)]
        if len({type(m) for _, m in children}) != 1:
            continue
        shapes = [_tensors(m) for _, m in children]
        if any(s != shapes[0] for s in shapes) or not shapes[0]:
            continue
        ids = [id(t) for _, m in children for t in [*m.parameters(), *m.buffers()]]
        if len(ids) != len(set(ids)):
            continue
        if best is None or len(children) > len(best.children):
            best = Stack(path, [name for name, _ in children])
    return best


def _tensors(module: nn.Module) -> list:
    return [(n, tuple(t.shape), t.dtype, t.requires_grad)
            for n, t in [*module.named_parameters(), *module.named_buffers()]]


class _Recorder(TorchDispatchMode):
    """Every op dispatched, with the layer of the stack it ran in (None outside)."""

    def __init__(self):
        super().__init__()
        self.layer: int | None = None
        self.ops: list[tuple] = []   # (layer, op, argument leaves, output tensors)
        self.keep: list = []         # outputs kept alive, so that no id is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.keep.append(out)
        self.ops.append((self.layer, func, tree_leaves((args, kwargs or {})), outs))
        return out


def record(root: nn.Module, stack: Stack, args, kwargs, mode) -> list[tuple] | None:
    """The ops of `root(*args, **kwargs)` on `mode`'s fake tensors, per section: the code
    before the stack, each layer, the code after it, as signatures (`_signatures`); None when
    the stack's structure is not one layer feeding the next."""
    container = root.get_submodule(stack.path)
    layers = [container[int(c)] if isinstance(container, nn.ModuleList) else container[c]
              for c in stack.children]
    rec = _Recorder()
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(rec, "layer", i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(rec, "layer", None)))
    try:
        with mode, rec:
            root(*args, **kwargs)
    except Exception:  # noqa: BLE001 - export, run next, reports what fails with the user's line
        return None
    finally:
        for h in hooks:
            h.remove()
    named = {id(t): n for n, t in [*root.named_parameters(remove_duplicate=False),
                                   *root.named_buffers(remove_duplicate=False)]}
    for k, t in enumerate(tree_leaves((args, kwargs))):
        if isinstance(t, torch.Tensor):
            named.setdefault(id(t), f"input {k}")
    return _signatures(rec.ops, len(layers), named, [stack.layer(i) + "." for i in
                                                     range(len(layers))])


def _signatures(ops: list[tuple], n: int, named: dict[int, str], prefixes: list[str]):
    """Per section ("pre", 0..n-1, "post"), the tuple of (op, canonical arguments, outputs);
    None when the layers do not run once each in order, an op outside the layers runs between
    two of them, or an op reads a layer other than its own and the previous one (the code
    after the stack: the last)."""
    sections: dict = {"pre": []}
    where: dict[int, tuple] = {}   # tensor id -> (section, op index, output position)
    entered: list[int] = []        # layers in the order they ran
    for layer, func, leaves, outs in ops:
        if layer is None:
            sec = "post" if entered else "pre"
            if sec == "post" and len(entered) < n:
                return None  # code between layers
        else:
            if "post" in sections:
                return None  # a layer ran again after the code after the stack
            if not entered or entered[-1] != layer:
                if layer != len(entered):
                    return None  # out of order, or again
                entered.append(layer)
            sec = layer
        canon = []
        for a in leaves:
            c = _canonical(a, sec, where, named, prefixes, n) \
                if isinstance(a, torch.Tensor) else ("v", a)
            if c is None:
                return None
            canon.append(c)
        body = sections.setdefault(sec, [])
        for pos, t in enumerate(outs):
            where[id(t)] = (sec, len(body), pos)
        body.append((func, tuple(canon), len(outs)))
    if len(entered) != n:
        return None
    sections.setdefault("post", [])
    return {k: tuple(v) for k, v in sections.items()}


def _canonical(t: torch.Tensor, sec, where, named, prefixes, n):
    """How an op of section `sec` names its tensor argument `t` (None: not allowed)."""
    if id(t) in where:
        src, idx, pos = where[id(t)]
        if src == sec:
            return ("own", idx, pos)
        if src == "pre":
            return ("pre", idx, pos)
        if isinstance(sec, int) and src == sec - 1:
            return ("prev", idx, pos)
        if sec == "post" and src == n - 1:
            return ("last", idx, pos)
        return None
    name = named.get(id(t))
    if name is None:
        return None
    for i, prefix in enumerate(prefixes):
        if name.startswith(prefix):
            return ("param", name[len(prefix):]) if i == sec else None
    return ("named", name)


def foldable(full: dict | None, cut: dict | None) -> bool:
    """Whether the whole model's record (`full`) and the two-layer model's (`cut`) say that
    copying layer 1 gives every further layer."""
    if full is None or cut is None:
        return False
    n = len(full) - 2
    return all(full[i] == full[1] for i in range(2, n)) and cut["pre"] == full["pre"] and \
        cut[0] == full[0] and cut[1] == full[1] and cut["post"] == full["post"]


def cut(root: nn.Module, stack: Stack):
    """Replace the stack's container by one of its first two layers; returns a function that
    puts the whole one back."""
    parent_path, _, attr = stack.path.rpartition(".")
    parent = root.get_submodule(parent_path)
    whole = getattr(parent, attr)
    if isinstance(whole, nn.ModuleList):
        short = nn.ModuleList([whole[0], whole[1]])
    else:
        short = nn.ModuleDict({c: whole[c] for c in stack.children[:2]})
    setattr(parent, attr, short)
    return lambda: setattr(parent, attr, whole)


def unfold(gm: fx.GraphModule, stack: Stack, placeholder_of: dict[str, fx.Node]
           ) -> dict[int, dict[str, fx.Node]] | None:
    """Copy layer 1's nodes of the exported two-layer graph `gm` for layers 2..N-1, in place
    (in its graph: the caller recompiles it).
    `placeholder_of` maps layer 1's parameter and buffer names (relative to the layer) to
    their placeholders. Returns, per new layer, its new placeholders by relative name; None
    (and `gm` untouched) when the graph's two layers are not alike."""
    graph = gm.graph
    ordered = list(graph.nodes)
    first, second = ([n for n in ordered if n.op == "call_function" and _layer_of(n, stack) == i]
                     for i in (0, 1))
    if not first or len(first) != len(second) or \
            any(a.target != b.target for a, b in zip(first, second)):
        return None
    span = ordered[ordered.index(first[0]):ordered.index(second[-1]) + 1]
    if any(n.op == "call_function" and _layer_of(n, stack) is None for n in span):
        return None  # code between the two layers
    position = {node: k for k, node in enumerate(first)}
    after = max(placeholder_of.values(), key=ordered.index)
    anchor, previous = second[-1], second
    new_inputs: dict[int, dict[str, fx.Node]] = {}
    env: dict[fx.Node, fx.Node] = {}
    inside = set(first) | set(second)
    for i in range(2, len(stack.children)):
        inputs = {}
        for rel, old in placeholder_of.items():
            with graph.inserting_after(after):
                after = inputs[rel] = graph.placeholder(_placeholder_name(old.name, stack, i))
            after.meta = dict(old.meta)
        new_inputs[i] = inputs
        by_old = {old: inputs[rel] for rel, old in placeholder_of.items()}
        env = {}

        def arg(a, env=env, by_old=by_old, previous=previous):
            if a in env:
                return env[a]
            if a in by_old:
                return by_old[a]
            if a in position:  # layer 1 reads layer 0: layer i reads layer i-1
                return previous[position[a]]
            return a

        for node in second:
            with graph.inserting_after(anchor):
                anchor = env[node] = graph.node_copy(node, arg)
            anchor.meta = dict(node.meta)
            anchor.meta["nn_module_stack"] = _renamed(node.meta.get("nn_module_stack"), stack,
                                                      i)
        previous = [env[node] for node in second]
        inside.update(previous)
    for node in second:  # the code after the stack reads the last layer
        for user in list(node.users):
            if user not in inside:
                user.replace_input_with(node, env[node])
    graph.lint()  # (the caller recompiles `gm` once its graph is final)
    return new_inputs


def _layer_of(node: fx.Node, stack: Stack) -> int | None:
    """0 or 1: which of the two-layer graph's layers made `node` (None: neither)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        for i in (0, 1):
            name = stack.layer(i)
            if path == name or path.startswith(name + "."):
                return i
    return None


def _renamed(stack_meta: dict | None, stack: Stack, i: int) -> dict | None:
    """A node's module stack (export's {"L__self__" + path: (path, type)}) with layer 1's
    path renamed to layer i's."""
    if not stack_meta:
        return stack_meta
    old, new = stack.layer(1), stack.layer(i)

    def rename(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path

    return {(f"L__self__{rename(p)}" if k == f"L__self__{p}" else k): (rename(p), t)
            for k, (p, t) in stack_meta.items()}


def _placeholder_name(name: str, stack: Stack, i: int) -> str:
    """Layer i's placeholder name from layer 1's (export's spelling: dots as underscores)."""
    old = stack.layer(1).replace(".", "_") + "_"
    new = stack.layer(i).replace(".", "_") + "_"
    return name.replace(old, new, 1) if old in name else f"{name}_{i}"
