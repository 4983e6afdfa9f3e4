"""Writes into activations made functional: the program every rank runs has no in-place op on
a tensor the graph computed.

torch.export's training IR keeps in-place ops. A write into an activation through a view
(`h[:, :4] *= 2`, `h[:, 0] = -1`, `h.narrow(1, 2, 4).mul_(3)`, `logits[:, pad] = -inf`)
appears as an in-place op on a view node, and the ops that read `h` afterwards read the node
that computed it: the write reaches them only through storage shared in eager mode. Once
`h` is sharded, or its write runs on a gathered copy, that sharing is gone and the write is
lost. So each such write becomes what functionalization makes of it:

    v = slice(h, 1, 0, 4);  mul_(v, 2)
 -> v = slice(h, 1, 0, 4);  w = mul(v, 2);  h2 = slice_scatter(h, w, 1, 0, 4)

and every later reader of `h`, or of a view of `h` taken before the write, reads `h2` (or
the same view taken of `h2`). Autograd of the scatter ops is what eager autograd does for a
write through a view (CopySlices), so gradients are exact too.

Writes into graph inputs (buffers, a user's input) are left as they are: the runtime runs
them whole on every rank (passes/trace.py `input_writes`). A write through a view this pass
cannot invert (a detached alias, a strided view) or by an op without a functional overload
is a TraceError naming the model line.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .torch_compat import shares_storage

aten = torch.ops.aten


class WriteError(RuntimeError):
    """A write into an activation that cannot be made functional (passes/trace.py raises it
    as a TraceError with the model line)."""


def written_arg(node: fx.Node) -> int | None:
    """The position of the argument an in-place op writes into, or None for other nodes."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            return i
    return None


_SPLITS = (aten.split, aten.split_with_sizes, aten.chunk, aten.unbind)


def _is_view(node: fx.Node) -> bool:
    """Whether `node` returns a tensor aliasing its first argument: a view op, or an element
    of a split's views (not the split's list itself)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        split = node.args[0]
        return isinstance(split, fx.Node) and split.op == "call_function" and \
            getattr(split.target, "overloadpacket", None) in _SPLITS
    schema = getattr(node.target, "_schema", None)
    returns = schema.returns if schema is not None else []
    if len(returns) != 1 or returns[0].alias_info is None or written_arg(node) is not None \
            or node.target.overloadpacket in _SPLITS:
        return False
    # ops that may alias (reshape, flatten, contiguous, to) are views only where they did
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return source is not None and shares_storage(node.meta.get("val"), source.meta.get("val"))


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _view_input(view: fx.Node) -> fx.Node:
    """The tensor `view` is a view of (a split element's: the split's input)."""
    return view.args[0].args[0] if view.target is operator.getitem else view.args[0]


def _as_view_op(view: fx.Node) -> tuple:
    """`view` as (op, arguments after the viewed tensor, keyword arguments): an element of a
    split as the slice or select that takes it."""
    if view.target is not operator.getitem:
        return view.target, tuple(view.args[1:]), dict(view.kwargs)
    split, index = view.args
    x = split.args[0].meta["val"]
    if split.target.overloadpacket is aten.unbind:
        return aten.select.int, (_arg(split, 1, "dim", 0), index), {}
    dim = _arg(split, 2, "dim", 0) % x.dim()
    sizes = [p.shape[dim] for p in split.meta["val"]]
    start = sum(sizes[:index])
    return aten.slice.Tensor, (dim, start, start + sizes[index], 1), {}


def _scatter(graph: fx.Graph, view: fx.Node, base: fx.Node, src: fx.Node) -> fx.Node:
    """A node putting `src` (the new value of `view`) into `base` (the value of the tensor
    `view` was taken of): the inverse of one view op."""
    target, args, kwargs = _as_view_op(view)
    packet = target.overloadpacket
    if packet is aten.slice:
        dim, start, end, step = (list(args) + [0, None, None, 1][len(args):])[:4]
        dim, start, end, step = (kwargs.get("dim", dim), kwargs.get("start", start),
                                 kwargs.get("end", end), kwargs.get("step", step))
        return graph.call_function(aten.slice_scatter.default,
                                   (base, src, dim, start, end, step))
    if packet is aten.select:
        return graph.call_function(aten.select_scatter.default, (base, src, *args))
    if packet is aten.narrow:
        dim, start, length = args
        return graph.call_function(aten.slice_scatter.default,
                                   (base, src, dim, start, start + length, 1))
    if packet is aten.diagonal:
        return graph.call_function(aten.diagonal_scatter.default, (base, src, *args), kwargs)
    if packet in (aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze,
                  aten.flatten, aten.unflatten, aten.view_as, aten.alias):
        # a view of all of the base's elements: the new base is the new value in its shape
        return graph.call_function(aten.view.default, (src, list(base.meta["val"].shape)))
    if packet is aten.t:
        return graph.call_function(aten.t.default, (src,))
    if packet is aten.transpose:
        return graph.call_function(aten.transpose.int, (src, *args))
    if packet is aten.permute:
        dims = [d % len(args[0]) for d in args[0]]
        return graph.call_function(aten.permute.default,
                                   (src, [dims.index(i) for i in range(len(dims))]))
    if packet is aten.detach:
        raise WriteError(f"a write through {target}: a detached view, or a tensor written "
                         "inside torch.no_grad(), whose new values autograd would not see")
    raise WriteError(f"a write through {target} (a view autopar cannot put back into the "
                     "tensor it views)")


def _written_value(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A node computing, out of place, what the in-place `node` writes into its first
    argument (mul_ -> mul; copy_ -> its source cast and broadcast to the destination, as
    aten.copy has no derivative)."""
    if node.target is not aten.copy_.default:
        op = _functional(node)
        if op is None:
            raise WriteError(f"{node.target} writes into a tensor the model computed and has "
                             "no out-of-place form autopar knows")
        value = fake_value(_copy_meta(node, graph.call_function(op, node.args, dict(node.kwargs))))
        dtype = node.args[0].meta["val"].dtype
        if value.meta["val"].dtype != dtype:  # an in-place op keeps its tensor's dtype
            value = fake_value(_copy_meta(node, graph.call_function(
                aten._to_copy.default, (value,), {"dtype": dtype})))
        return value
    dest, src = node.args[0].meta["val"], node.args[1]
    if src.meta["val"].dtype != dest.dtype:
        src = fake_value(_copy_meta(node, graph.call_function(aten._to_copy.default, (src,),
                                                         {"dtype": dest.dtype})))
    return fake_value(_copy_meta(node, graph.call_function(aten.expand.default,
                                                      (src, list(dest.shape)))))


def _functional(node: fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place op computing what the in-place `node` writes (mul_ -> mul), or None
    where torch has none."""
    name = node.target.overloadpacket.__name__
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    return getattr(packet, node.target._overloadname, None) if packet is not None else None


def _writes_back(node: fx.Node, origin: dict, root: fx.Node, chain: list[fx.Node],
                 newest: fx.Node) -> bool:
    """Whether `node` copies into a view the value that view holds already: Python's
    `h[:, :4] *= 2` is an in-place product on the view, then a copy of the view into the
    same place of `h`."""
    if node.target is not aten.copy_.default or not isinstance(node.args[1], fx.Node):
        return False
    src_root, src_chain, src_start = origin.get(node.args[1], (None, None, None))
    return src_root is root and src_start is newest and \
        [_as_view_op(v) for v in src_chain] == [_as_view_op(v) for v in chain] and \
        node.args[1].meta["val"].dtype == node.args[0].meta["val"].dtype


def fake_value(node: fx.Node) -> fx.Node:
    """Fill `node.meta["val"]` by running its op on its arguments' fake values."""
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a
    args = fx.node.map_aggregate(node.args, val)
    kwargs = fx.node.map_aggregate(node.kwargs, val)
    node.meta["val"] = node.target(*args, **kwargs)
    return node


def _copy_meta(source: fx.Node, node: fx.Node) -> fx.Node:
    """Give `node` the model line and module of `source` (and its value, when it has none)."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in source.meta:
            node.meta[key] = source.meta[key]
    if "val" in source.meta and "val" not in node.meta:
        node.meta["val"] = source.meta["val"]
    return node


def functionalize_activation_writes(gm: fx.GraphModule) -> int:
    """Rewrite every in-place op of `gm` that writes into a tensor the graph computed (not a
    graph input) through a view, or whose tensor is read afterwards through its old node or
    a view taken before, as its out-of-place op plus the scatters that put the result back
    into the written tensor; later readers read the new value. Returns how many writes were
    rewritten; raises WriteError (with `.node` set) for a write it cannot make functional."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    views = {node for node in graph.nodes if _is_view(node)}  # on the values as traced
    # a view -> (the tensor at the root of its views, the views from there, the value of
    # that root they were taken of); roots are absent
    origin: dict[fx.Node, tuple[fx.Node, list[fx.Node], fx.Node]] = {}
    latest: dict[fx.Node, fx.Node] = {}  # a root -> the node holding its value now
    rederived: dict[tuple[fx.Node, fx.Node], fx.Node] = {}
    count = 0

    def current(value: fx.Node, before: fx.Node) -> fx.Node:
        """`value` as it reads now: the same views of its root's latest value."""
        root, chain, start = origin.get(value, (value, [], value))
        newest = latest.get(root, root)
        if start is newest:
            return value
        if (value, newest) not in rederived:
            out, views = newest, []
            with graph.inserting_before(before):
                for view in chain:
                    target, args, kwargs = _as_view_op(view)
                    out = _copy_meta(view, graph.call_function(target, (out, *args), kwargs))
                    views.append(out)
                    origin[out] = (root, list(views), newest)
            rederived[(value, newest)] = out
        return rederived[(value, newest)]

    def read_later(root: fx.Node, node: fx.Node) -> bool:
        """Whether a node after `node` reads `root`, or a view of it, other than through
        `node`'s result."""
        values = [root, *(v for v, (r, _, _) in origin.items() if r is root)]
        return any(order.get(user, -1) > order[node] for v in values for user in v.users
                   if user is not node)

    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        node.args = fx.node.map_arg(node.args, lambda a, at=node: current(a, at))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a, at=node: current(a, at))
        written = written_arg(node)
        if written is None:
            if node in views:
                viewed = _view_input(node)
                root, chain, start = origin.get(viewed, (viewed, [], viewed))
                origin[node] = (root, [*chain, node], start)
            continue
        target = _arg(node, written, node.target._schema.arguments[written].name)
        root, chain, start = origin.get(target, (target, [], target))
        if root.op == "placeholder":
            continue  # a graph input: written by the runtime (trace.input_writes)
        # with no view between and no reader of the old value, the in-place op's own result
        # is what its readers read: made functional where torch has the op out of place (the
        # sharding rules know those), kept where it has not
        in_place_ok = not chain and not read_later(root, node)
        if _writes_back(node, origin, root, chain, latest.get(root, root)):
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
            continue
        if in_place_ok and (written != 0 or _functional(node) is None):
            continue
        try:
            if written != 0:
                raise WriteError(f"{node.target} writes into its argument "
                                 f"{node.target._schema.arguments[written].name}")
            with graph.inserting_before(node):
                value = new = _written_value(graph, node)
                for view in reversed(chain):
                    new = fake_value(_copy_meta(node, _scatter(graph, view, _view_input(view),
                                                               new)))
        except WriteError as e:
            e.node = node
            raise
        latest[root] = new
        origin[new] = (root, [], new)
        origin[value] = (root, chain, new)  # the op returns its written view, of the new value
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        count += 1
    if count:
        graph.eliminate_dead_code()
        gm.recompile()
    return count
