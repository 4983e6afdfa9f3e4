"""How the losses of a step's microbatches add up to the loss of the whole batch.

Gradient accumulation runs a batch as m equal microbatches and adds up their gradients, each
microbatch's loss weighted so that the sum is the loss of the whole batch. Which weights do
that depends on the loss, read here from the traced graph's last op:

- a sum over the batch (`reduction="sum"`, `loss.sum()`): weight 1 each;
- a mean over samples (`reduction="mean"` of an elementwise loss, `loss.mean()`): 1/m each;
- a mean over the targets a cross-entropy or negative log-likelihood counts (its default
  `reduction="mean"` skips targets equal to `ignore_index`, padding in language models):
  each microbatch's count over the batch's (`counter` computes a microbatch's count from the
  program's inputs); 1/m is right only when every microbatch counts as many;
- anything else (a sum of several terms, a loss divided by a traced size): the user's
  `loss_reduction` option says which of the first two it is (`kind` "").

Some models cannot be split at all: BatchNorm in training mode normalizes each microbatch by
its own statistics and updates its running statistics once per microbatch (`coupled` names
the op and its model line), so no weighting gives the whole batch's result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .torch_compat import tree_leaves
from .trace import TracedProgram, module_path, source_line

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
_BATCH_NORMS = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5,
                aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit_functional.default: 5}


@dataclass(frozen=True)
class LossWeights:
    """How a traced program's loss combines over microbatches (see the module docstring):
    `kind` "sum", "mean", "targets" or "" (the user's loss_reduction decides); `counter`
    (for "targets") maps the program's inputs, in order, to the count of targets the loss
    averages over; `coupled` is "" or why the model's microbatches cannot add up to the
    batch; `refused` is "" or why the targets cannot be counted before the step."""

    kind: str = ""
    counter: fx.GraphModule | None = None
    coupled: str = ""
    refused: str = ""

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
    node = loss
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    if node.op != "call_function":
        return LossWeights(coupled=coupled)
    target = node.target
    if target in _TARGET_MEANS:
        at, ignore_at = _TARGET_MEANS[target]
        reduction = _arg(node, at, "reduction", 1)
        if reduction == 2:
            return LossWeights("sum", coupled=coupled)
        if reduction != 1:
            return LossWeights(coupled=coupled)
        if _arg(node, 2, "weight", None) is not None:
            return LossWeights("targets", coupled=coupled, refused=(
                f"{target} weights its classes: its mean divides by the weights of each "
                f"microbatch's targets{_where(node, prefix)}"))
        counter, why = _target_counter(gm, inputs, node.args[1], _arg(node, ignore_at,
                                                                      "ignore_index", -100))
        return LossWeights("targets", counter, coupled, why)
    if target in _ELEMENT_LOSSES:
        reduction = _arg(node, _ELEMENT_LOSSES[target], "reduction", 1)
        kind = {1: "mean", 2: "sum"}.get(reduction, "")
        return LossWeights(kind, coupled=coupled)
    over_all = not _arg(node, 1, "dim", None)  # (sum / mean over every dimension)
    if target is aten.sum.default or target is aten.sum.dim_IntList and over_all:
        return LossWeights("sum", coupled=coupled)
    if target is aten.mean.default or target is aten.mean.dim and over_all:
        return LossWeights("mean", coupled=coupled)
    return LossWeights(coupled=coupled)


def loss_tail(program: TracedProgram) -> list[str]:
    """The nodes of `program` that make its loss out of the samples' values: the op the
    weights are read from (its last that is not a cast, view or copy) and those after it."""
    if not program.has_loss:
        return []
    out = next(n for n in program.graph.nodes if n.op == "output")
    node, names = tree_leaves(out.args[0])[-1], []
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        names.append(node.name)
        node = node.args[0]
    if node.op == "call_function":
        names.append(node.name)
    return names


def of_program(program: TracedProgram, per_rank_inputs: bool = False) -> LossWeights:
    """`loss_weights` of a traced program's loss (none for an inference program). With
    `per_rank_inputs` (every rank passes its own slice of the batch) a loss averaging over
    the targets it counts cannot be weighted: no rank sees every microbatch's targets."""
    out = next(n for n in program.graph.nodes if n.op == "output")
    loss = tree_leaves(out.args[0])[-1] if program.has_loss else None
    weights = loss_weights(program.graph_module, program.inputs, loss, program.module_prefix)
    if per_rank_inputs and weights.kind == "targets" and not weights.refused:
        weights = LossWeights("targets", None, weights.coupled, (
            "the loss averages over the targets it counts (a cross-entropy's mean skips "
            "those equal to ignore_index), and with per_rank_inputs no rank sees every "
            "microbatch's targets to weight them"))
    return weights


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
    (kind "targets"), `mean` the user's loss_reduction for a loss autopar cannot read."""
    if weights.kind == "targets" and counts is not None:
        total = sum(counts)
        return [c / total if total else 1.0 / m for c in counts]
    if weights.kind == "sum" or (weights.kind == "" and not mean):
        return [1.0] * m
    return [1.0 / m] * m
