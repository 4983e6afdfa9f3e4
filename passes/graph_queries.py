"""What a traced graph says about the model: the ops that draw random numbers, where a node
comes from in the user's code (source line, module path), the inputs and buffers it writes, and
the hooks a trace cannot carry."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from .trace_error import TraceError


def random_draws(gm: fx.GraphModule) -> list[str]:
    """The ops of `gm` that draw random numbers when run (dropout in training, SDPA with
    dropout_p > 0, rand/randn/bernoulli...), as "op at model line"."""
    return [f"{node.target} at {source_line(node) or node.name}" for node in drawing_ops(gm)]


def drawing_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of `gm` that draw random numbers when run (see `random_draws`)."""
    return [node for node in gm.graph.nodes if draws_random(node)]


def draws_random(node: fx.Node) -> bool:
    """Whether `node` draws random numbers when run: an op torch tags as seeded, except
    dropout that does not train or has p = 0 and SDPA with dropout_p = 0."""
    if node.op != "call_function" or \
            torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    packet = node.target.overloadpacket
    if packet in (torch.ops.aten.dropout, torch.ops.aten.native_dropout):
        p, train = (list(node.args[1:3]) + [True])[:2]
        return bool(train and p)
    if packet is torch.ops.aten.scaled_dot_product_attention:
        return bool(node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0))
    if node.target in _RECURRENT:  # (input, hx, params, has_biases, layers, dropout, train, ...)
        return bool(node.args[5] and node.args[6])
    return True


# nn.GRU, nn.LSTM and nn.RNN on padded batches: they draw only for dropout between layers
_RECURRENT = (torch.ops.aten.gru.input, torch.ops.aten.lstm.input,
              torch.ops.aten.rnn_tanh.input, torch.ops.aten.rnn_relu.input)


def untraced_hooks(model: nn.Module) -> str | None:
    """Why `model` cannot be traced as it runs, or None: hooks that run in backward (a
    module's full backward hooks, a parameter's gradient hooks) are not part of the traced
    forward, so the programs would never run them. Forward hooks and pre-hooks are traced."""
    for name, m in model.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            return (f"module {name or type(m).__name__} ({type(m).__name__}) has a backward "
                    "hook (register_full_backward_hook / register_backward_hook), which the "
                    "traced programs would never run; remove it, or do its work on the "
                    "gradients after step() returns")
    for name, p in model.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            return gradient_hook_message(name)
    return None


def gradient_hook_message(name: str) -> str:
    """The error for a gradient hook on parameter `name`."""
    return (f"parameter {name} has a gradient hook (register_hook or "
            "register_post_accumulate_grad_hook), which autopar never runs: it computes "
            "gradients on copies of its own. Transform the gradients after step() returns "
            "(p.grad is complete then), or before the optimizer step")


def source_line(node: fx.Node) -> str:
    """The model line that made `node` ("File ..., line N, in f: code"), or "" when FX recorded
    none: the innermost frame of its stack trace outside torch."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 2, -1, -1):
        if lines[i].startswith("File ") and "site-packages/torch" not in lines[i]:
            return f"{lines[i]}: {lines[i + 1]}" if i + 1 < len(lines) else lines[i]
    return ""


def module_path(node: fx.Node, prefix: str = "") -> str:
    """The model's module that made `node` (its innermost `nn_module_stack` entry, e.g.
    "model.layers.3.mlp.up_proj"), without the tracing wrapper's `prefix`; "" for the model
    itself (and for the loss function)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if prefix and (path + ".") == prefix:
        return ""
    return path.removeprefix(prefix)


def _mutation_message(what: str, where: str) -> str:
    return (f"the model updates a parameter in place ({what}){where}; autopar stores "
            "parameters sharded, so the update would land on a gathered copy. Update "
            "parameters in the optimizer step (or in a hook after it), not in forward.")


def input_writes(gm: fx.GraphModule, params: set[str]) -> dict[str, str]:
    """The ops that write into a graph input (the training IR of export keeps in-place updates
    in the graph: BatchNorm's num_batches_tracked += 1, a MoE router's token counts), as
    {node: input}; writing into a view of an input counts as writing into the input. A
    parameter written in place is a TraceError (its storage is sharded; the write would land
    on a gathered copy)."""
    out = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            base = input_base(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
            if base is None:
                continue
            if base.name in params:
                where = source_line(node)
                raise TraceError(_mutation_message(
                    f"{node.target} writes parameter {base.name}",
                    f"\n  at {where}" if where else ""))
            out[node.name] = base.name
    return out


# Composite norms whose schema does not mark the running statistics they update in training
# mode: the position of the `training` flag and of the running statistics.
_RUNNING_STATS = {torch.ops.aten.batch_norm.default: (5, (3, 4)),
                  torch.ops.aten.native_batch_norm.default: (5, (3, 4)),
                  torch.ops.aten.instance_norm.default: (5, (3, 4))}


def state_writes(gm: fx.GraphModule, writes: dict[str, str] | None = None
                 ) -> dict[str, set[str]]:
    """The ops of `gm` that write into graph inputs in forward, with the inputs each writes:
    `writes` (`input_writes` of `gm`, as TracedProgram.writes keeps it; found when not given)
    and the norms that update running statistics held in graph inputs (BatchNorm in training
    mode: aten.batch_norm, whose schema does not say it writes them; in a rank's program, the
    callable a rule lowered it to, whose `writes_args` says which arguments it updates)."""
    out = {n: {i} for n, i in (input_writes(gm, set()) if writes is None else writes).items()}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _RUNNING_STATS:
            flag, stats = _RUNNING_STATS[node.target]
            training = node.args[flag] if len(node.args) > flag else node.kwargs.get("training")
            if training is not True:
                continue
        elif getattr(node.target, "writes_args", None):
            # a norm lowered for a rank's program (passes/rules/norms.py sync_batch_norm's
            # callable): the positions of the arguments it updates in place
            stats = node.target.writes_args
        else:
            continue
        for i in stats:
            base = input_base(node.args[i] if len(node.args) > i else None)
            if base is not None:
                out.setdefault(node.name, set()).add(base.name)
    return out


def input_base(value) -> fx.Node | None:
    """The graph input `value` is (a view of), or None."""
    while isinstance(value, fx.Node):
        if value.op == "placeholder":
            return value
        schema = getattr(value.target, "_schema", None)
        returns = schema.returns if schema is not None else []
        if value.op != "call_function" or not returns or returns[0].alias_info is None:
            return None
        value = value.args[0]
    return None
