"""Trace a model (and its loss) into a functional ATen FX graph with FakeTensor shapes.

The graph is what torch.export (non-strict) produces as training IR, cleaned so that later passes
see one flat graph: higher-order wrappers that only toggle grad mode are inlined, and metadata
assertions are dropped. Every call_function node carries ``meta["val"]`` (a FakeTensor or a tuple
of them).
"""

from __future__ import annotations

import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


class TraceError(RuntimeError):
    """The model cannot be captured as one static graph; the message names the model line."""


@dataclass
class TracedProgram:
    """A model (plus optional loss) as one flat ATen graph.

    `params` maps placeholder names to the model's canonical parameter names (tied weights share
    one name); `buffers` maps placeholder names to buffer or constant keys whose values are in
    `constants` (filled lazily by the runtime, since a planning-only model may live on meta).
    `inputs` are the user-input placeholders in call order; when a loss was traced the last one
    is the target. The graph returns the model's flattened outputs, followed by the loss.
    """

    graph_module: fx.GraphModule
    params: dict[str, str]
    buffers: dict[str, str]
    inputs: list[str]
    out_spec: pytree.TreeSpec
    num_outputs: int
    has_loss: bool
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph


class _WithLoss(nn.Module):
    """Makes one traceable forward of model + loss: returns (model outputs, loss)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        *inputs, target = args
        out = self.model(*inputs)
        return out, self.loss_fn(out, target)


def trace(model: nn.Module, example_inputs: tuple, loss_fn=None, example_target=None
          ) -> TracedProgram:
    """Trace `model(*example_inputs)` (and `loss_fn(output, example_target)` when given).

    Raises TraceError naming the model's source line for data-dependent control flow and for
    inputs that are not tensors.
    """
    example_inputs = tuple(example_inputs)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TraceError(
                f"input {i} is a {type(x).__name__}, not a tensor: autopar shards tensors only. "
                "Pass non-tensor settings to the model's constructor, or wrap the model so that "
                "its forward takes tensors only.")
    root: nn.Module = model
    args = example_inputs
    if loss_fn is not None:
        if example_target is None:
            raise TraceError("loss_fn was given but no example target to trace it with")
        root = _WithLoss(model, loss_fn)
        args = (*example_inputs, example_target)
    try:
        ep = torch.export.export(root, args, strict=False)
    except Exception as e:  # noqa: BLE001 - rewrapped with the user's line
        raise TraceError(_explain_export_failure(e)) from e

    gm = ep.graph_module
    _inline_grad_mode_wrappers(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()

    canonical = {id(p): name for name, p in model.named_parameters()}
    prefix = "model." if loss_fn is not None else ""
    params, buffers, inputs, constants = {}, {}, [], {}
    first_placeholder: dict[str, str] = {}  # tied weights: one placeholder per parameter
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            target = spec.target.removeprefix(prefix)
            pname = canonical[id(model.get_parameter(target))]
            if pname in first_placeholder:
                _merge_placeholder(gm, name, first_placeholder[pname])
                continue
            first_placeholder[pname] = name
            params[name] = pname
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target.removeprefix(prefix)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            buffers[name] = "constant:" + spec.target
            constants[buffers[name]] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(name)
        else:
            raise TraceError(f"unsupported graph input {name} of kind {spec.kind.name}")
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"the model updates state in place ({spec.kind.name} of {spec.target}), e.g. "
                "BatchNorm running statistics; autopar needs a functional forward. Use eval-mode "
                "statistics or a normalization without running state.")
    if loss_fn is not None:
        _unalias_outputs(gm, num_model_outputs=len(ep.graph_signature.output_specs) - 1)
    out_spec = ep.call_spec.out_spec
    num_flat = len(ep.graph_signature.output_specs)
    if loss_fn is not None:
        # out_spec is (model_out, loss); keep the model's own structure for the outputs.
        out_spec = out_spec.child(0) if hasattr(out_spec, "child") else out_spec.children_specs[0]
        num_outputs = num_flat - 1
    else:
        num_outputs = num_flat
    return TracedProgram(gm, params, buffers, inputs, out_spec, num_outputs,
                         loss_fn is not None, constants)


def _unalias_outputs(gm: fx.GraphModule, num_model_outputs: int) -> None:
    """Export may return a model output as an alias made by the loss (e.g. the first result of
    `broadcast_tensors(output, target)`); point the output back at the value itself, so that the
    model's outputs never depend on the target."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(out.args[0])
    for i in range(num_model_outputs):
        n = flat[i]
        while isinstance(n, fx.Node):
            if n.op == "call_function" and n.target is operator.getitem and \
                    n.args[0].target is torch.ops.aten.broadcast_tensors.default:
                src = n.args[0].args[0][n.args[1]]
                if src.meta["val"].shape != n.meta["val"].shape:
                    break
                n = src
            elif n.op == "call_function" and n.target is torch.ops.aten.alias.default:
                n = n.args[0]
            else:
                break
        flat[i] = n
    out.args = (type(out.args[0])(flat),)
    gm.recompile()


def _merge_placeholder(gm: fx.GraphModule, dup: str, keep: str) -> None:
    """Route the uses of a tied parameter's second placeholder to its first, and drop it."""
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    nodes[dup].replace_all_uses_with(nodes[keep])
    gm.graph.erase_node(nodes[dup])
    gm.recompile()


def _inline_grad_mode_wrappers(gm: fx.GraphModule) -> None:
    """Inline `wrap_with_set_grad_enabled` and friends (used e.g. by HF rotary embeddings).

    Values inside such regions carry no gradient in the models we trace (positions, buffers),
    so running their ops inline keeps the semantics.
    """
    hop_names = {"wrap_with_set_grad_enabled", "wrap_with_autocast"}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") not in hop_names:
            continue
        if node.target.__name__ == "wrap_with_set_grad_enabled":
            sub_attr, sub_args = node.args[1], node.args[2:]
        else:  # wrap_with_autocast(device, dtype, enabled, cache, submod, *args)
            sub_attr, sub_args = node.args[4], node.args[5:]
        sub = getattr(gm, sub_attr.target)
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, arg in zip(placeholders, sub_args):
            env[ph] = arg
        result = None
        with gm.graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    continue
                if sn.op == "output":
                    result = pytree.tree_map(
                        lambda a, env=env: env[a] if isinstance(a, fx.Node) else a, sn.args[0])
                    break
                new = gm.graph.node_copy(sn, env.__getitem__)
                env[sn] = new
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        gm.graph.erase_node(sub_attr)
        delattr(gm, sub_attr.target)
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "higher_order":
            raise TraceError(
                f"unsupported higher-order op {node.target.__name__} at node {node.name}: "
                "autopar needs one flat graph (no torch.cond, checkpoint or while_loop)")


def _explain_export_failure(e: Exception) -> str:
    """Point at the user's line: the innermost traceback frame outside torch and site-packages."""
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    user = [f for f in frames if not f.filename.startswith(torch_dir)
            and "site-packages" not in f.filename and "<" not in f.filename
            and not f.filename.endswith(os.path.join("passes", "trace.py"))]
    where = f"{user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else "unknown line"
    kind = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else kind
    data_dependent = any(s in f"{kind} {e}" for s in (
        "data-dependent", "DataDependent", "GuardOnDataDependent", "Could not guard",
        "Could not extract specialized integer", "symbolic", "item()"))
    hint = ("The model branches on tensor values (data-dependent control flow), which a static "
            "graph cannot express. Replace the Python `if`/loop on a tensor value with tensor ops "
            "(torch.where, masking) or move it out of forward." if data_dependent
            else "autopar could not capture the model with torch.export (non-strict).")
    return f"{hint}\n  at {where}\n  torch.export said: {kind}: {text}"
