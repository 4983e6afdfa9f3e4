"""How the losses of a step's microbatches add up to the loss of the whole batch.

Gradient accumulation runs a batch as m equal microbatches and adds up their gradients, each
microbatch's loss weighted so that the sum is the loss of the whole batch. Which weights do
that depends on the loss, read here from the traced graph's last op:

- a sum over the batch (`reduction="sum"`, `loss.sum()`): weight 1 each;
- a mean over samples (`reduction="mean"` of an elementwise loss, `loss.mean()`): 1/m each;
- a mean over the targets a cross-entropy or negative log-likelihood counts (its default
  `reduction="mean"` skips targets equal to `ignore_index`, padding in language models):
  each microbatch's count over the batch's (`counter` computes a microbatch's count from the
  program's inputs); 1/m is right only when every microbatch counts as many. Against
  probability targets (soft labels) a cross-entropy's mean is over samples: 1/m each;
- any of these multiplied or divided by numbers (`loss.sum() / B`, a token count as a
  Python int): the weight above times the whole batch's number over the microbatch's.
  Microbatch programs are traced at the microbatch's shapes, so a number the loss closes over
  (B) stays the whole batch's (`sum / B`: weight 1 each) while a size read from a shape
  (`sum / x.shape[0]`) becomes the microbatch's (weight 1/m each);
- anything else (a sum of several terms, a sum divided by a tensor): autopar cannot read it,
  and the user's `loss_reduction` option says which of the first two it is (`kind` ""); without
  the option such a loss is not split (`refused`), never weighted on an assumption.

Some models cannot be split at all: BatchNorm in training mode normalizes each microbatch by
its own statistics and updates its running statistics once per microbatch (`coupled` names
the op and its model line), so no weighting gives the whole batch's result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_queries import module_path, source_line
from .torch_compat import tree_leaves
from .trace import TracedProgram

aten = torch.ops.aten

# ops that compute a loss from (input, target, ...) with `reduction` (0 none, 1 mean, 2 sum)
_TARGET_MEANS = {  # mean over the targets not equal to ignore_index: (reduction, ignore_index)
    aten.cross_entropy_loss.default: (3, 4),
    aten.nll_loss.default: (3, 4),
    aten.nll_loss_nd.default: (3, 4),
    aten.nll_loss2d.default: (3, 4),
}
_ELEMENT_LOSSES = {  # elementwise losses: the position of `reduction`
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4, aten.soft_margin_loss.default: 2,
}
_PASS_THROUGH = {aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.clone.default,
                 aten.view.default, aten.reshape.default, aten.squeeze.default,
                 aten.squeeze.dim, aten.unsqueeze.default}
_SCALINGS = {aten.mul.Tensor: False, aten.mul.Scalar: False,  # op: divides
             aten.div.Tensor: True, aten.div.Scalar: True}
_BATCH_NORMS = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5,
                aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit_functional.default: 5}


@dataclass(frozen=True)
class LossWeights:
    """How a traced program's loss combines over microbatches (see the module docstring):
    `kind` "sum", "mean", "targets" or "" (the user's loss_reduction decides); `counter`
    (for "targets") maps the program's inputs, in order, to the count of targets the loss
    averages over; `coupled` is "" or why the model's microbatches cannot add up to the
    batch; `refused` is "" or why the loss cannot be weighted (its targets cannot be counted
    before the step, or autopar cannot read it and loss_reduction was not given). `scale` is
    the number the program multiplies the reduction of kind `kind` by (`loss.sum() / 8`: 1/8),
    `whole_scale` the whole batch's program's (None: the same)."""

    kind: str = ""
    counter: fx.GraphModule | None = None
    coupled: str = ""
    refused: str = ""
    scale: float = 1.0
    whole_scale: float | None = None

    def exact(self) -> str:
        """"" when gradient accumulation gives the whole batch's result, else why not."""
        return self.coupled or self.refused


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _where(node: fx.Node, prefix: str = "") -> str:
    """Where the model made `node`: its module, else its model line."""
    module = module_path(node, prefix)
    line = source_line(node)
    return f" (module {module})" if module else f" ({line})" if line else ""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _reduction(loss: fx.Node) -> tuple[fx.Node, float, list[str]]:
    """The op that reduces the loss, read back from its output `loss` through casts, views,
    copies, negations and multiplications or divisions by numbers; the number those multiply
    it by; the names of the nodes passed (from `loss` back, the op's last)."""
    node, scale, names = loss, 1.0, []
    while node.op == "call_function":
        if node.target in _PASS_THROUGH or node.target is aten.neg.default:
            scale = -scale if node.target is aten.neg.default else scale
            names.append(node.name)
            node = node.args[0]
            continue
        divides = _SCALINGS.get(node.target)
        args = node.args[:2]
        if divides is None or len(args) != 2:
            break
        if isinstance(args[0], fx.Node) and _number(args[1]):
            other, number = args
        elif not divides and _number(args[0]) and isinstance(args[1], fx.Node):
            number, other = args
        else:
            break
        if divides and number == 0:
            break
        scale = scale / number if divides else scale * number
        names.append(node.name)
        node = other
    if node.op == "call_function":
        names.append(node.name)
    return node, scale, names


def _floating(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def loss_weights(gm: fx.GraphModule, inputs: list[str], loss: fx.Node | None,
                 prefix: str = "") -> LossWeights:
    """How the loss node `loss` of graph `gm` (whose user inputs are the placeholders
    `inputs`, in order; its module paths start with `prefix`) combines over microbatches."""
    coupled = ""
    for node in gm.graph.nodes:
        slot = _BATCH_NORMS.get(node.target) if node.op == "call_function" else None
        if slot is not None and _arg(node, slot, "training", False):
            coupled = ("BatchNorm in training mode normalizes each microbatch by its own "
                       f"statistics{_where(node, prefix)}")
            break
    if loss is None:
        return LossWeights(coupled=coupled)
    node, scale, _ = _reduction(loss)
    weights = _read(gm, inputs, node, prefix)
    if not weights.kind:  # loss_reduction says what the whole loss is, numbers included
        return LossWeights(coupled=coupled)
    return dataclasses.replace(weights, coupled=coupled, scale=scale)


def _read(gm: fx.GraphModule, inputs: list[str], node: fx.Node, prefix: str) -> LossWeights:
    """`loss_weights` of the op `node` that reduces the loss (`coupled` and `scale` aside)."""
    if node.op != "call_function":
        return LossWeights()
    target = node.target
    if target in _TARGET_MEANS:
        at, ignore_at = _TARGET_MEANS[target]
        reduction = _arg(node, at, "reduction", 1)
        if reduction != 1:
            return LossWeights("sum" if reduction == 2 else "")
        if _floating(node.args[1]):  # probability targets: a mean over the samples
            return LossWeights("mean")
        if _arg(node, 2, "weight", None) is not None:
            return LossWeights("targets", refused=(
                f"{target} weights its classes: its mean divides by the weights of each "
                f"microbatch's targets{_where(node, prefix)}"))
        counter, why = _target_counter(gm, inputs, node.args[1], _arg(node, ignore_at,
                                                                      "ignore_index", -100))
        return LossWeights("targets", counter, refused=why)
    if target in _ELEMENT_LOSSES:
        reduction = _arg(node, _ELEMENT_LOSSES[target], "reduction", 1)
        return LossWeights({1: "mean", 2: "sum"}.get(reduction, ""))
    over_all = not _arg(node, 1, "dim", None)  # (sum / mean over every dimension)
    if target is aten.sum.default or target is aten.sum.dim_IntList and over_all:
        return LossWeights("sum")
    if target is aten.mean.default or target is aten.mean.dim and over_all:
        return LossWeights("mean")
    return LossWeights()


def loss_tail(program: TracedProgram) -> list[str]:
    """The nodes of `program` that make its loss out of the samples' values: the op the
    weights are read from (its last that is not a cast, view, copy, negation or
    multiplication or division by a number) and those after it."""
    loss = _loss_node(program)
    return _reduction(loss)[2] if loss is not None else []


def _loss_node(program: TracedProgram) -> fx.Node | None:
    """The node a traced program returns its loss from (None for an inference program)."""
    if not program.has_loss:
        return None
    out = next(n for n in program.graph.nodes if n.op == "output")
    return tree_leaves(out.args[0])[-1]


def _weights(program: TracedProgram) -> LossWeights:
    return loss_weights(program.graph_module, program.inputs, _loss_node(program),
                        program.module_prefix)


def of_program(program: TracedProgram, per_rank_inputs: bool = False,
               loss_reduction: str | None = "mean", whole: TracedProgram | None = None
               ) -> LossWeights:
    """`loss_weights` of a traced program's loss (none for an inference program). With
    `per_rank_inputs` (every rank passes its own slice of the batch) a loss averaging over
    the targets it counts cannot be weighted: no rank sees every microbatch's targets. A loss
    autopar cannot read is weighted as `loss_reduction` says ("mean" or "sum"), and refused
    when it is None (the user did not say). `whole`: the program of the whole batch, when
    `program` is one microbatch's, whose loss's number (`whole_scale`) may differ."""
    loss = _loss_node(program)
    weights = _weights(program)
    if per_rank_inputs and weights.kind == "targets" and not weights.refused:
        weights = dataclasses.replace(weights, counter=None, refused=(
            "the loss averages over the targets it counts (a cross-entropy's mean skips "
            "those equal to ignore_index), and with per_rank_inputs no rank sees every "
            "microbatch's targets to weight them"))
    if loss is not None and not weights.kind and loss_reduction is None:
        weights = dataclasses.replace(weights, refused=_unread(_reduction(loss)[0]))
    if whole is not None and whole is not program and weights.kind:
        weights = dataclasses.replace(weights, whole_scale=_weights(whole).scale)
    return weights


def _unread(node: fx.Node) -> str:
    """Why a loss whose reduction autopar cannot read from its op `node` is not split."""
    line = source_line(node)
    where = " in the loss function" if "self.loss_fn(" in line else f" ({line})" if line else ""
    op = str(node.target).removeprefix("aten.") if node.op == "call_function" else node.name
    divides = " (a division by a tensor: a count or a mask's sum the loss captures or "\
        "computes)" if op.startswith("div.") else ""
    return (f"autopar cannot read how the loss adds up the batch's samples from its last op "
            f"{op}{where}{divides}, so it could weight each microbatch's loss only on an "
            "assumption; pass loss_reduction=\"sum\" or loss_reduction=\"mean\" to say which "
            "the whole loss is, or end the loss with a reduction autopar reads (a sum or a "
            "mean, F.cross_entropy's mean with ignore_index, any of them multiplied or "
            "divided by a Python number)")


def _target_counter(gm: fx.GraphModule, inputs: list[str], target, ignore_index: int
                    ) -> tuple[fx.GraphModule | None, str]:
    """A graph from the program's inputs to the number of elements of `target` (a node of
    `gm`) not equal to `ignore_index`: the ops that make the target from the inputs (a shift,
    a view), copied. None, and why, when the target depends on anything but the inputs."""
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in needed:
            continue
        if n.op == "placeholder" and n.name not in inputs:
            return None, ("the loss's targets are computed from the model's parameters or "
                          f"buffers ({n.name}), so they cannot be counted before the step")
        if n.op not in ("placeholder", "call_function"):
            return None, f"the loss's targets come from {n.op} {n.name}"
        needed.add(n)
        stack.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    for n in gm.graph.nodes:
        if n in needed and n.op == "call_function":
            env[n] = graph.node_copy(n, lambda a: env[a])
    counted = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (counted,)))
    return fx.GraphModule(gm, graph), ""


def microbatch_weights(weights: LossWeights, counts: list[int] | None, m: int,
                       mean: bool) -> list[float]:
    """The weight of each of `m` microbatches' losses: `counts` are the targets each counts
    (kind "targets"), `mean` the user's loss_reduction for a loss autopar cannot read. A
    microbatch's loss multiplied by another number than the whole batch's (a size read from
    a shape) is weighted by the whole batch's number over its own."""
    factor = 1.0 if weights.whole_scale is None else weights.whole_scale / weights.scale
    if weights.kind == "targets" and counts is not None:
        total = sum(counts)
        return [factor * c / total if total else factor / m for c in counts]
    if weights.kind == "sum" or (weights.kind == "" and not mean):
        return [factor] * m
    return [factor / m] * m
