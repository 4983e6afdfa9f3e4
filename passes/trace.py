"""Trace a model (and its loss) into a functional ATen FX graph with FakeTensor shapes.

The graph is what torch.export (non-strict) produces as training IR, cleaned so that later passes
see one flat graph: higher-order wrappers that only toggle grad mode are inlined, and metadata
assertions are dropped. Every call_function node carries ``meta["val"]`` (a FakeTensor or a tuple
of them).

Folding (`trace`'s `fold`, `beside`, `deferred`, `copies`): a stack of identical layers
(passes/fold.py) is exported cut to two layers and the second copied for the others, when a
recorded run on fake tensors shows that this gives the graph export would. With `beside`, a
stack of at least BESIDE_LAYERS layers is checked in a forked child process while this one
exports two layers and copies them (passes/forked.py; on a CPU device, where the machine has a
second core): the whole model's record is most of a deep model's tracing time. When the check
says the layers differ, the whole model is exported instead. With `deferred` (a list) as well,
the check still running when the two layers are exported is appended to it instead of waited
for: the program returned is then valid only if its `result()` is True (layers that differ:
trace again with `fold=False`), and the caller must call `result()` or `cancel()` on it. With
`copies` the caller knows the stack's layers to be copies (checked on this model at another
batch, or being checked with the caller waiting for that check): not checked. Only the stack's
first two layers are copied to fake tensors (the export's; the model's parameter names come
from `model`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind

from . import fold as layer_fold
from .export_checks import (
    check_no_side_effects,
    check_scalar_loss,
    check_static_shapes,
    explain_export_failure,
    same_constants,
)
from .forked import Forked, can_fork
from .functionalize import WriteError, functionalize_activation_writes
from .graph_queries import (  # noqa: F401  (re-exported: the trace's queries)
    drawing_ops,
    draws_random,
    gradient_hook_message,
    input_base,
    input_writes,
    module_path,
    random_draws,
    source_line,
    state_writes,
    untraced_hooks,
)
from .meta_copies import (  # noqa: F401  (re-exported)
    computed_attribute,
    fake_copy,
    fake_tensor,
    meta_copy,
    plain_tensors,
)
from .row_reshape import unflatten_row_chains
from .side_effects import SideEffectWatch
from .soundness import SoundnessGate
from .torch_compat import (
    ASSERTION_OPS,
    TreeSpec,
    checkpointed,
    fake_mode,
    grad_mode_region,
    innermost_stack_traces,
    is_higher_order,
    spec_child,
    static_fake_mode,
    tree_map,
    watch_checkpoints,
)
from .trace_error import TraceError

BESIDE_LAYERS = 16  # `trace(beside=True)` checks stacks this deep in a child process


@dataclass
class TracedProgram:
    """A model (plus optional loss) as one flat ATen graph.

    `params` maps placeholder names to the model's canonical parameter names (tied weights share
    one name); `buffers` maps placeholder names to buffer or constant keys whose values are in
    `constants` (filled lazily by the runtime, since a planning-only model may live on meta).
    `inputs` are the user-input placeholders in call order (positional inputs, the target when
    a loss function was traced, then keyword inputs in `kwarg_names` order); `in_spec` is the
    pytree structure of `(args, kwargs)` they were flattened from. The graph returns the model's
    flattened outputs, followed by the loss when one was traced (`has_loss`): `loss_fn(output,
    target)`, or the loss the model itself returns (`output_loss`). `random_ops` names the ops
    that draw random numbers (with their model lines).
    """

    graph_module: fx.GraphModule
    params: dict[str, str]
    buffers: dict[str, str]
    inputs: list[str]
    out_spec: TreeSpec
    num_outputs: int
    has_loss: bool
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    in_spec: TreeSpec | None = None
    kwarg_names: tuple[str, ...] = ()
    has_target: bool = False
    random_ops: list[str] = field(default_factory=list)
    module_prefix: str = ""   # what the model's module paths start with in nn_module_stack
    writes: dict[str, str] = field(default_factory=dict)  # node -> graph input it updates
    frozen: set[str] = field(default_factory=set)  # parameter placeholders that do not train
    checkpointed: set[str] = field(default_factory=set)  # ops under torch.utils.checkpoint
    folded: str = ""  # the stack of identical layers traced once and copied (passes/fold.py)
    compute_dtype: torch.dtype | None = None  # traced in this dtype (mixed precision)
    # strategy graphs built for this program (passes/strategies.py `build`), by mesh shape and
    # input placement: the planner tries several ways to fit memory on one program
    strategy_graphs: dict = field(default_factory=dict, repr=False, compare=False)
    # what `build` reads of each op node whatever the mesh (its OpCall, tensor inputs and the
    # key of its candidates), worked out at the first mesh
    op_calls: dict = field(default_factory=dict, repr=False, compare=False)
    # whether the program mixes its batch's samples, by loss reduction (passes/batch_local.py
    # `mixing`): the same answer at every level and microbatch count of a search
    mixing: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph


class _Found:
    """Whether the model returned a loss (an object forward fills, so that the side-effect
    check sees no attribute of the wrapper change)."""

    found = False


class _Step(nn.Module):
    """One traceable forward of the model and its loss: `loss_fn(outputs, target)` (the target
    is the last positional argument), or the loss the model returns (`output_loss`: True when
    it must, "auto" when it may; `result.found` says whether it did). Returns (outputs, loss),
    or the outputs alone without a loss.

    Under mixed precision (`compute_dtype`) the model's floating-point inputs are cast to it,
    and its floating-point outputs back to float32 (so the loss is computed in float32), as
    FSDP2's MixedPrecisionPolicy casts forward inputs."""

    def __init__(self, model: nn.Module, loss_fn=None, output_loss=False,
                 compute_dtype: torch.dtype | None = None, source: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.output_loss = output_loss
        self.compute_dtype = compute_dtype
        self.result = _Found()
        self.source = None if source is None else weakref.ref(source)

    def forward(self, *args, **kwargs):
        if self.loss_fn is not None:
            *args, target = args
        if self.compute_dtype is not None:
            args, kwargs = tree_map(lambda t: _cast(t, self.compute_dtype), (args, kwargs))
        out = self.model(*args, **kwargs)
        if self.compute_dtype is not None:
            out = tree_map(lambda t: _cast(t, torch.float32), out)
        if self.loss_fn is not None:
            with lent(None if self.source is None else self.source(), self.model):
                return out, self.loss_fn(out, target)
        loss = output_loss(out, self.output_loss is True) if self.output_loss else None
        self.result.found = loss is not None
        return (out, loss) if loss is not None else out


@contextlib.contextmanager
def lent(source: nn.Module | None, traced: nn.Module):
    """While the block runs (the loss function), `source`'s modules hold the tensors of their
    counterparts in `traced` (its copy being traced; the dictionaries themselves, into which
    export puts its tracing tensors): a loss function reading the model's tensors
    (`model.c.weight` in an L2 term, class weights in `model.cw`) reads the traced ones, so
    that they are inputs of the program (a parameter's term differentiated) instead of
    constants. A module `traced` lacks (a layer of a stack traced as two copies) lends
    nothing: reading its tensor raises _ReadsFoldedLayer."""
    if source is None:
        yield
        return
    counterparts = dict(traced.named_modules())
    saved = []
    for path, m in source.named_modules():
        twin = counterparts.get(path)
        saved.append((m, m.__dict__["_parameters"], m.__dict__["_buffers"]))
        for kind in ("_parameters", "_buffers"):
            m.__dict__[kind] = getattr(twin, kind) if twin is not None else \
                _Unlent(path, m.__dict__[kind])
    try:
        yield
    finally:
        for m, params, buffers in saved:
            m.__dict__["_parameters"], m.__dict__["_buffers"] = params, buffers


class _ReadsFoldedLayer(TraceError):
    """The loss function read a tensor of a layer the trace copies (`lent`)."""


class _Unlent(dict):
    """The tensors of a module the traced copy lacks: reading one raises."""

    def __init__(self, path: str, tensors: dict):
        super().__init__(tensors)
        self.path = path

    def __getitem__(self, name):
        raise _ReadsFoldedLayer(f"the loss function reads {self.path}.{name}")


def _cast(t, dtype: torch.dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def output_loss(out, required: bool = True):
    """The loss a model returns: the output itself when it is a scalar tensor, else its `loss`
    field (Hugging Face's ModelOutput.loss, or a dict's "loss"); None when there is none and
    it is not `required`."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise TraceError(f"the model returned a loss of shape {tuple(loss.shape)}, not a "
                             "scalar: reduce it to a scalar (mean or sum) in the model")
        return loss
    if not required:
        return None
    kind = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) \
        else type(out).__name__
    raise TraceError(
        f"step() without loss_fn needs the model to return its loss (a scalar tensor, or an "
        f"output with a `loss` field, as Hugging Face models do when given labels); it "
        f"returned {kind}. Pass loss_fn= to parallelize, or pass the labels the model needs "
        "to compute its loss.")


def trace(model: nn.Module, example_inputs: tuple, loss_fn=None, example_target=None, *,
          kwargs: dict | None = None, output_loss: bool | str = False,
          device: torch.device | None = None,
          compute_dtype: torch.dtype | None = None, fold: bool = True,
          beside: bool = False, deferred: list[Forked] | None = None,
          copies: bool = False, source: nn.Module | None = None) -> TracedProgram:
    """Trace `model(*example_inputs, **kwargs)` and its loss: `loss_fn(output, example_target)`
    when `loss_fn` is given, the loss the model returns when `output_loss` (True: it must
    return one; "auto": when it does).

    The model is traced as a copy without storage whose tensors are fake tensors on `device`,
    the device the program runs on (default: the model's device, cpu for a meta model): model
    code that branches on its tensors' device (autocast regions, kernels a device lacks) takes
    the branch it takes there, and tensors the graph creates are created there.
    With `compute_dtype` (mixed precision) the graph computes in that dtype: its parameters
    are that dtype (the runtime feeds casts of the float32 master weights), floating-point
    inputs are cast to it and outputs back to float32 inside the graph.

    A stack of identical layers is exported as two layers copied (`fold`, `beside`,
    `deferred`, `copies`: the module docstring's "Folding"). With `source` (the model `model`
    copies, which `loss_fn` may read) the loss function reads the traced tensors where it
    reads `source`'s (`lent`); a read of a layer traced as a copy exports every layer.

    Raises TraceError naming the model's source line for data-dependent control flow and
    data-dependent shapes, for inputs that are not tensors, for a loss that is not one scalar
    and for forward changing the model's Python attributes (a change the traced graph would
    never repeat).
    """
    example_inputs, kwargs = _tensor_inputs(example_inputs, kwargs)
    device = _device_of(model, device)
    user_model, user_inputs, user_kwargs, user_target = \
        model, example_inputs, kwargs, example_target

    def trace_whole() -> TracedProgram:  # every layer exported (the fake copy has two)
        return trace(user_model, user_inputs, loss_fn, user_target, kwargs=user_kwargs,
                     output_loss=output_loss, device=device, compute_dtype=compute_dtype,
                     fold=False, source=source)

    mode = fake_mode()
    inner = layer_fold.repeated_layers(model) if fold else None
    # a stack's first two layers are what export runs: a fake copy of every layer took 0.7 s
    # of Llama-3 70B's 2 s of tracing
    restore = layer_fold.cut(model, inner) if inner is not None else None
    try:
        model = fake_copy(model, mode, device, compute_dtype)
    finally:
        if restore is not None:
            restore()
    example_inputs = tuple(fake_tensor(t, mode, device) for t in example_inputs)
    kwargs = {k: fake_tensor(t, mode, device) for k, t in kwargs.items()}
    example_target = fake_tensor(example_target, mode, device)
    root: nn.Module = model
    args = example_inputs
    if loss_fn is not None and example_target is None:
        raise TraceError("loss_fn was given but no example target to trace it with")
    if loss_fn is not None or output_loss or compute_dtype is not None:
        root = _Step(model, loss_fn, output_loss if loss_fn is None else False, compute_dtype,
                     source)
        if loss_fn is not None:
            args = (*example_inputs, example_target)
    watched = "" if root is not model else "model"
    stack = None if inner is None else layer_fold.Stack(
        ("model." if root is not model else "") + inner.path, inner.children)  # in `root`
    check = None
    if stack is not None and not copies:
        whole = user_model if root is model else \
            _Step(user_model, root.loss_fn, root.output_loss, compute_dtype, source)
        verdict = functools.partial(_fold_verdict, whole, stack, args, kwargs, device,
                                    watched, compute_dtype)
        if beside and len(stack.children) >= BESIDE_LAYERS and device.type == "cpu" and \
                can_fork():
            check = Forked(verdict)  # the check runs beside the export of two layers
        elif not verdict():
            return trace_whole()
    try:
        try:
            program = _program(_export(root, args, kwargs, watched, stack), root,
                               user_model, loss_fn, stack, compute_dtype)
        except _ReadsFoldedLayer:
            if stack is None:
                raise
            program = None  # the loss reads a layer the two-layer copy lacks
        except TraceError:
            if check is None or check.result():
                raise
            program = None  # two layers that differ, as the check says
        else:
            if check is not None and deferred is not None:
                deferred.append(check)  # the caller waits for it
                check = None
            elif check is not None and not check.result():
                program = None
    finally:
        if check is not None:
            check.cancel()
    if program is None:  # the layers are not copies of each other: export them all
        return trace_whole()
    return program


def _tensor_inputs(example_inputs, kwargs: dict | None) -> tuple[tuple, dict]:
    """The inputs as a tuple and a dict, every one a tensor (else a TraceError)."""
    example_inputs, kwargs = tuple(example_inputs), dict(kwargs or {})
    for i, x in [*enumerate(example_inputs), *kwargs.items()]:
        if not isinstance(x, torch.Tensor):
            what = f"input {i}" if isinstance(i, int) else f"keyword input {i!r}"
            raise TraceError(
                f"{what} is a {type(x).__name__}, not a tensor: autopar shards tensors only. "
                "Pass non-tensor settings to the model's constructor, or wrap the model so that "
                "its forward takes tensors only.")
    return example_inputs, kwargs


def _device_of(model: nn.Module, device) -> torch.device:
    """`device`, or the model's (the first tensor not on meta; cpu for a meta model)."""
    if device is None:
        device = next((t.device for t in [*model.parameters(), *model.buffers()]
                       if t.device.type != "meta"), torch.device("cpu"))
    return torch.device(device)


def _program(ep, root: nn.Module, model: nn.Module, loss_fn, stack: layer_fold.Stack | None,
             compute_dtype: torch.dtype | None) -> TracedProgram:
    """The traced program of `ep`, the export of `root` (a fake copy of `model`, or the _Step
    wrapping one), cut to two layers of `stack` when given (copied here for the others);
    parameters are named as in `model`."""
    gm = ep.graph_module
    check_static_shapes(gm)
    if loss_fn is not None:
        check_scalar_loss(gm, spec_child(ep.call_spec.out_spec, 1), loss_fn)

    _inline_grad_mode_wrappers(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERTION_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _functionalize(gm)
    unflatten_row_chains(gm)  # nn.MultiheadAttention's (L*N, E) projection keeps N apart

    canonical = {id(p): name for name, p in model.named_parameters()}
    with_loss = loss_fn is not None or (isinstance(root, _Step) and root.result.found)
    prefix = "model." if isinstance(root, _Step) else ""
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
    if stack is not None:
        _unfold(gm, stack, ep, params, buffers, canonical, model, prefix)
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"the model updates {spec.target} in place and export returned it as a "
                f"{spec.kind.name} output, which autopar does not run; update state outside "
                "forward")
    unaliased = with_loss and \
        _unalias_outputs(gm, num_model_outputs=len(ep.graph_signature.output_specs) - 1)
    if stack is not None or unaliased:
        gm.recompile()  # once, after the graph's last change (a whole model's code: 0.2 s)
    out_spec = ep.call_spec.out_spec
    num_flat = len(ep.graph_signature.output_specs)
    if with_loss:
        # out_spec is (model_out, loss); keep the model's own structure for the outputs.
        out_spec = spec_child(out_spec, 0)
        num_outputs = num_flat - 1
    else:
        num_outputs = num_flat
    in_spec = ep.call_spec.in_spec
    kwarg_spec = spec_child(in_spec, 1)
    return TracedProgram(gm, params, buffers, inputs, out_spec, num_outputs, with_loss,
                         constants, in_spec, tuple(kwarg_spec.context or ()),
                         loss_fn is not None, random_draws(gm), prefix,
                         input_writes(gm, set(params)),
                         {ph for ph, name in params.items()
                          if not model.get_parameter(name).requires_grad},
                         {n.name for n in gm.graph.nodes if checkpointed(n)},
                         stack.path.removeprefix(prefix) if stack is not None else "",
                         compute_dtype)


def _export(root: nn.Module, args, kwargs, prefix: str, stack: layer_fold.Stack | None):
    """torch.export of `root` (cut to the stack's first two layers, when given), non-strict;
    raises TraceError naming the model's line for what export cannot capture, and for
    forward changing the model's Python state at every call.

    A change made once for good is accepted: forward sets an attribute from what it is given
    (Swin sets its window shift from the input's resolution) and, with the attributes as it
    left them (`SideEffectWatch.replay`), a second export changes nothing and records the
    same graph. Every call then computes that graph, the first included, and the program
    runs it; anything else (a counter, a list appended to, a value read before it is set)
    is refused, and so is a tensor left in a changed attribute (a constant the graph's code
    does not show). A loss function reading the user's model reads it with the change made
    too (`SideEffectWatch.replay_onto`), so a loss reading a changed value traces otherwise
    and is refused."""
    ep, watch = _export_once(root, args, kwargs, prefix, stack)
    if not watch.changes():
        return ep
    if watch.left_tensors():
        check_no_side_effects(watch.changes())
    watch.replay()
    source = root.source() if isinstance(root, _Step) and root.source is not None else None
    try:
        restore = watch.replay_onto(source, "model") if source is not None else None
    except AttributeError:  # the user's model is not laid out as its traced copy
        check_no_side_effects(watch.changes())
    try:
        again, second = _export_once(root, args, kwargs, prefix, stack)
    finally:
        if restore is not None:
            restore()
    if second.changes() or again.graph_module.code != ep.graph_module.code or \
            not same_constants(ep.constants, again.constants):
        check_no_side_effects(watch.changes())
    return again


def _export_once(root: nn.Module, args, kwargs, prefix: str, stack: layer_fold.Stack | None):
    """(the export of `root`, the SideEffectWatch that watched it): see `_export`."""
    restore = layer_fold.cut(root, stack) if stack is not None else None
    try:
        with SideEffectWatch(root, prefix=prefix) as watch, \
                SoundnessGate(root, prefix, _refuse) as gate, \
                watch_checkpoints(_refuse_checkpoint), innermost_stack_traces():
            ep = torch.export.export(root, args, kwargs, strict=False)
        gate.check(ep, source_line)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - rewrapped with the user's line
        if isinstance(e.__cause__, TraceError):
            raise e.__cause__ from None
        raise TraceError(explain_export_failure(e)) from e
    finally:
        if restore is not None:
            restore()
    return ep, watch


def _fold_verdict(root: nn.Module, stack: layer_fold.Stack, args, kwargs, device,
                  prefix: str, compute_dtype: torch.dtype | None = None) -> bool:
    """Whether the records of the whole model and of the model cut to two layers say that
    copying layer 1 of the stack (passes/fold.py) gives every layer; not when forward changes
    the model's Python state (the model is then exported whole, and `_export` judges it).

    The records run on a copy of `root` (its floating-point parameters in `compute_dtype`,
    when given) under a fake mode without a shape environment (ops
    dispatch in about 0.6 of the time; what needs one, such as a size read from a tensor's
    values, fails the record and the model is exported whole)."""
    mode = static_fake_mode()
    root = fake_copy(root, mode, device, compute_dtype)
    args, kwargs = tree_map(lambda t: fake_tensor(t, mode, device), (args, kwargs))
    with SideEffectWatch(root, prefix=prefix) as watch:
        full = layer_fold.record(root, stack, args, kwargs, mode)
        restore = layer_fold.cut(root, stack)
        try:
            short = layer_fold.record(root, layer_fold.Stack(stack.path, stack.children[:2]),
                                      args, kwargs, mode)
        finally:
            restore()
    # forward changes state: exported whole, where _export accepts a change made for good
    return not watch.changes() and layer_fold.foldable(full, short)


def _unfold(gm: fx.GraphModule, stack, ep, params: dict, buffers: dict, canonical: dict,
            model: nn.Module, prefix: str) -> None:
    """Copy layer 1 of the two-layer graph `gm` for the stack's further layers, adding their
    placeholders to `params` and `buffers` (in the model's parameter order)."""
    layer1 = stack.layer(1) + "."
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    placeholder_of, kinds = {}, {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and \
                spec.target.startswith(layer1) and spec.arg.name in nodes:
            rel = spec.target[len(layer1):]
            placeholder_of[rel], kinds[rel] = nodes[spec.arg.name], spec.kind
    added = layer_fold.unfold(gm, stack, placeholder_of)
    if added is None:
        raise TraceError("autopar could not copy the repeated layers of the traced model "
                         f"({stack.path}); trace with fold=False")
    for i, inputs in added.items():
        for rel, node in inputs.items():
            target = f"{stack.layer(i)}.{rel}".removeprefix(prefix)
            if kinds[rel] == InputKind.PARAMETER:
                params[node.name] = canonical[id(model.get_parameter(target))]
            else:
                buffers[node.name] = target
    order = {name: k for k, (name, _) in enumerate(model.named_parameters())}
    ordered = sorted(params.items(), key=lambda kv: order[kv[1]])
    params.clear()
    params.update(ordered)


def trace_example(model: nn.Module, example: tuple, loss_fn=None) -> TracedProgram:
    """`trace` for `example` as `step` receives it: the model's inputs, followed by the target
    when `loss_fn` is given."""
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    if loss_fn is None:
        return trace(model, example)
    if len(example) < 2:
        raise TraceError("with loss_fn, the example is the model inputs followed by the "
                         "target, as passed to step(*inputs, target)")
    return trace(model, example[:-1], loss_fn, example[-1])


def _unalias_outputs(gm: fx.GraphModule, num_model_outputs: int) -> bool:
    """Export may return a model output as an alias made by the loss (e.g. the first result of
    `broadcast_tensors(output, target)`); point the output back at the value itself, so that the
    model's outputs never depend on the target. Whether the graph changed (the caller then
    recompiles `gm`)."""
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
    if flat == list(out.args[0]):
        return False
    out.args = (type(out.args[0])(flat),)
    return True


def _merge_placeholder(gm: fx.GraphModule, dup: str, keep: str) -> None:
    """Route the uses of a tied parameter's second placeholder to its first, and drop it."""
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    nodes[dup].replace_all_uses_with(nodes[keep])
    gm.graph.erase_node(nodes[dup])
    gm.recompile()


def _detached(gm: fx.GraphModule, value: fx.Node) -> fx.Node:
    """`value` detached (a tensor computed under no_grad carries no gradient)."""
    if not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    out = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = {k: v for k, v in value.meta.items() if k != "unbacked_bindings"}
    return out


def _inline_grad_mode_wrappers(gm: fx.GraphModule) -> None:
    """Inline `wrap_with_set_grad_enabled` and disabled `wrap_with_autocast` regions (a
    `torch.no_grad()` block, HF rotary embeddings). The inputs and outputs of a region run
    without grad are detached, so nothing inside records a gradient and none flows back
    through it, as on one device. An enabled autocast
    region is a TraceError: inlined, its ops would run without its casts.
    """
    for node in list(gm.graph.nodes):
        region = grad_mode_region(node)
        if region is None:
            continue
        sub_attr, sub_args = region.submodule, region.args
        no_grad = not region.grad_enabled
        if region.autocast is not None:
            inside = getattr(gm, sub_attr.target).graph.nodes
            where = source_line(node) or next(
                (source_line(n) for n in inside if source_line(n)), "")
            raise TraceError(
                f"forward runs a region under torch.autocast (device {region.autocast[0]}, "
                f"dtype {region.autocast[1]}){f' at {where}' if where else ''}: autopar runs "
                "every op at the dtype of its inputs and would drop the region's casts. Cast "
                "explicitly in forward instead (x.to(torch.bfloat16)), or use precision="
                "\"bf16-mixed\".")
        sub = getattr(gm, sub_attr.target)
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        result = None
        with gm.graph.inserting_before(node):
            for ph, arg in zip(placeholders, sub_args):
                # under no_grad nothing inside records a gradient: its inputs enter detached
                # (an op writing into an `out=` tensor refuses inputs that require grad)
                env[ph] = _detached(gm, arg) if no_grad and isinstance(arg, fx.Node) else arg
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    continue
                if sn.op == "output":
                    result = tree_map(
                        lambda a, env=env: env[a] if isinstance(a, fx.Node) else a, sn.args[0])
                    if no_grad:
                        result = tree_map(
                            lambda a: _detached(gm, a) if isinstance(a, fx.Node) else a, result)
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
        if node.op == "call_function" and is_higher_order(node.target):
            raise TraceError(
                f"unsupported higher-order op {node.target.__name__} at node {node.name}: "
                "autopar needs one flat graph (no torch.cond, checkpoint or while_loop)")


def _functionalize(gm: fx.GraphModule) -> None:
    """Make writes into activations functional (passes/functionalize.py), or raise TraceError
    naming the model line of one it cannot."""
    try:
        functionalize_activation_writes(gm)
    except WriteError as e:
        where = source_line(e.node)
        raise TraceError(
            f"the model writes into a tensor in place ({e}){' at ' + where if where else ''}; "
            "autopar cannot make this write part of a sharded program. Write it out of place "
            "(e.g. torch.where, torch.cat, or x = x.clone() and index_put) instead.") from None


def _refuse(why: str):
    raise TraceError(why)


def _refuse_checkpoint(why: str):
    raise TraceError(f"{why}. Or remove the checkpoint: autopar recomputes activations by "
                     "plan (PlanOptions.recompute).")
