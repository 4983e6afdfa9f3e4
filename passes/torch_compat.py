"""The one module through which autopar uses PyTorch's private or version-dependent APIs.

autopar supports PyTorch 2.11 to 2.13. Everything below is either private (an underscore name,
which PyTorch may change in any release) or changed within that range; every other module of
autopar, in every layer, imports these names from here (this module sits in the lowest layer,
`autopar.passes`, and imports nothing of autopar). tests/test_torch_compat.py checks each one on
a tiny example, so a PyTorch release that changes one fails there, loudly, by name.

- pytrees (`torch.utils._pytree`, private): `tree_map`, `tree_leaves`, `tree_flatten`,
  `tree_unflatten`, `TreeSpec`, and `spec_child` (TreeSpec.child(i) from 2.13; the older
  `children_specs` list is deprecated there).
- collectives renamed in 2.13: `all_gather_single` (before: all_gather_into_tensor) and
  `reduce_scatter_single` (before: reduce_scatter_tensor); the old names remain, deprecated.
  With `all_to_all_single` and `all_reduce`, the collectives autopar calls.
- `default_store()`: the default process group's key-value store (private in distributed_c10d).
- `default_timeout()` and `set_timeout(group, timeout)`: the timeout init_process_group gave
  the default group, which groups made later (`new_group`, a DeviceMesh's dimensions) do not
  inherit (read from its backend's private options; set with c10d's `_set_pg_timeout`).
- torch.export's grad-mode regions (higher-order ops `wrap_with_set_grad_enabled` and
  `wrap_with_autocast`, whose argument layouts are internal): `grad_mode_region(node)`, and
  `is_higher_order(target)` for any other higher-order op.
- `free_unbacked_symbols` (torch.fx.experimental: sizes export could not bind to a number).
- `ASSERTION_OPS`: the ATen ops export leaves in the graph to assert metadata.
- `persistent_buffers(model)`: buffer names saved in state_dict (nn.Module's private set of
  non-persistent buffers).
- `watch_checkpoints(refuse)`: while tracing, marks the ops a model runs under
  `torch.utils.checkpoint` (non-reentrant; through its private generator and
  `torch.fx.traceback.annotate`), and calls `refuse(why)` for reentrant checkpoints (whose
  backward a trace cannot capture) and where this PyTorch cannot mark them;
  `checkpointed(node)` tells a marked node.
- `outside_dispatch_modes()`: runs what it wraps without the active `TorchDispatchMode`s
  (`torch.utils._python_dispatch._disable_current_modes`): selective checkpoint's recompute
  mode refuses any op its forward did not run, such as gathering a parameter again.
- `innermost_stack_traces()`: while tracing, FX records on each node only the innermost
  frame outside PyTorch (what autopar reads of a node's `stack_trace`) instead of
  symbolizing and formatting the whole Python stack (torch.fx.proxy's `CapturedTraceback`,
  replaced while tracing).
- `watch_backward_runs(refuse)`: while tracing, calls `refuse()` before any backward pass
  run from Python (`.backward()`, `torch.autograd.grad` however imported): both reach the
  engine through torch.autograd's private `_engine_run_backward`, replaced while tracing (a
  PyTorch without it has the public `torch.autograd.backward` and `grad` replaced instead,
  which misses a `grad` imported before; tests/test_torch_compat.py fails on such a PyTorch).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED = ((2, 11), (2, 13))  # the oldest and newest PyTorch (major, minor) autopar runs on


def spec_child(spec: TreeSpec, index: int) -> TreeSpec:
    """The spec of child `index` of a container's TreeSpec."""
    return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]


# -- collectives -----------------------------------------------------------------------------------

if TORCH_VERSION >= (2, 13):
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor
all_to_all_single = dist.all_to_all_single
all_reduce = dist.all_reduce


def default_store():
    """The key-value store the default process group was made with (torchrun's, or the
    init_method's): where ranks leave messages for each other when collectives cannot run."""
    return dist.distributed_c10d._get_default_store()


def default_timeout() -> datetime.timedelta:
    """The timeout the default process group was made with (init_process_group's `timeout=`,
    else torch's default for its backend); its backend's options hold it."""
    c10d = dist.distributed_c10d
    group = c10d._get_default_group()
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return c10d.default_pg_timeout


def set_timeout(group, timeout: datetime.timedelta) -> None:
    """Make the collectives of `group` (a process group this rank is in) time out after
    `timeout`."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


# -- torch.export's graphs -------------------------------------------------------------------------

_GRAD_MODE_OPS = {
    # higher-order op -> index of its submodule argument; the submodule's inputs follow it
    torch.ops.higher_order.wrap_with_set_grad_enabled: 1,   # (enabled, submodule, *args)
    torch.ops.higher_order.wrap_with_autocast: 4,  # (device, dtype, enabled, cache, submodule, *)
}

ASSERTION_OPS = frozenset({
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
})


@dataclass(frozen=True)
class GradModeRegion:
    """A submodule an exported graph calls under a grad-mode or autocast switch: the get_attr
    node holding it, the arguments it is called with, whether grad is enabled inside, and the
    autocast it runs under ((device, dtype) when an enabled autocast, else None)."""

    submodule: fx.Node
    args: tuple
    grad_enabled: bool
    autocast: tuple | None


def grad_mode_region(node: fx.Node) -> GradModeRegion | None:
    """The region `node` calls (see GradModeRegion), or None for any other node."""
    if node.op != "call_function":
        return None
    position = _GRAD_MODE_OPS.get(node.target)
    if position is None:
        return None
    if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
        grad, autocast = bool(node.args[0]), None
    else:
        grad, autocast = True, (node.args[0], node.args[1]) if node.args[2] else None
    return GradModeRegion(node.args[position], tuple(node.args[position + 1:]), grad, autocast)


def fake_mode():
    """A fresh FakeTensorMode with its own shape environment (what tracing runs under)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def static_fake_mode():
    """A fresh FakeTensorMode without a shape environment: static shapes only, and ops
    dispatch in about 0.6 of the time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def is_higher_order(target) -> bool:
    """Whether a call_function target is a higher-order op (cond, while_loop, checkpoint...)."""
    return getattr(target, "namespace", "") == "higher_order"


# -- modules ---------------------------------------------------------------------------------------

def persistent_buffers(model: nn.Module) -> set[str]:
    """The names (as named_buffers gives them) of `model`'s buffers that state_dict saves."""
    out = set()
    for prefix, m in model.named_modules():
        for name in m._buffers:
            if name not in m._non_persistent_buffers_set:
                out.add(f"{prefix}.{name}" if prefix else name)
    return out


__all__ = [
    "ASSERTION_OPS", "SUPPORTED", "TORCH_VERSION", "TreeSpec", "all_gather_single", "all_reduce",
    "all_to_all_single", "default_store", "default_timeout", "free_unbacked_symbols",
    "grad_mode_region", "is_higher_order", "persistent_buffers", "reduce_scatter_single",
    "set_timeout", "spec_child",
    "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten",
]


CHECKPOINT_MARK = "autopar_user_checkpoint"


@contextlib.contextmanager
def watch_checkpoints(refuse):
    """Within: ops a traced model runs under non-reentrant torch.utils.checkpoint carry a
    mark (`checkpointed`); a reentrant checkpoint calls `refuse(why)`, which raises."""
    import torch.utils.checkpoint as cp

    generator, function = cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction
    annotate = getattr(torch.fx.traceback, "annotate", None)

    def marked(*args, **kwargs):
        if annotate is None:
            refuse("this PyTorch cannot mark the ops of a torch.utils.checkpoint region while "
                   "tracing")
        with annotate({CHECKPOINT_MARK: True}):
            yield from generator(*args, **kwargs)

    class Reentrant:
        @staticmethod
        def apply(*args, **kwargs):
            refuse("torch.utils.checkpoint with use_reentrant=True runs its forward without "
                   "autograd, so a trace loses its gradients; pass use_reentrant=False "
                   "(PyTorch's recommendation)")

    cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = marked, Reentrant
    try:
        with torch.fx.traceback.preserve_node_meta():
            yield
    finally:
        cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = generator, function


def checkpointed(node: fx.Node) -> bool:
    """Whether a traced node ran under the model's own torch.utils.checkpoint."""
    return bool((node.meta.get("custom") or {}).get(CHECKPOINT_MARK))


def outside_dispatch_modes():
    """A context in which no `TorchDispatchMode` is active (those active are restored after)."""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@contextlib.contextmanager
def innermost_stack_traces():
    """Within: FX nodes record as their `stack_trace` only the frame autopar reads of it (the
    innermost frame outside PyTorch of those torch.fx keeps: under torch.export, frames of
    `forward` methods), where torch.fx symbolizes and formats every frame of the stack for
    every node and then filters them: a quarter to a third of exporting a Hugging Face model,
    whose stacks are deep. A PyTorch whose torch.fx.proxy records stack traces otherwise keeps
    its own (whole) ones."""
    original = getattr(fx.proxy, "CapturedTraceback", None)
    if original is None:
        yield
        return
    fx.proxy.CapturedTraceback = _InnermostFrame
    try:
        yield
    finally:
        fx.proxy.CapturedTraceback = original


class _InnermostFrame:
    """torch.utils._traceback.CapturedTraceback as torch.fx.proxy's `create_node` uses it,
    `extract().summary()`: the innermost frame outside PyTorch that the tracer's filter
    (`TracerBase._filter_traceback_frames`) keeps, or no frame. That filter keeps, for a
    tracer recording `forward` frames only (torch.export's), frames named `forward` and
    registered anchors; otherwise every frame from the outermost `forward` on."""

    __slots__ = ("frame",)

    def __init__(self, frame: tuple[str, int, str] | None):
        self.frame = frame

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> "_InnermostFrame":
        caller = sys._getframe(1)  # create_node, whose `self` is the tracer
        forward_only = getattr(caller.f_locals.get("self"), "_record_forward_stack_traces_only",
                               False)
        anchors = getattr(fx.proxy, "_STACK_TRACE_ANCHORS", ())
        f, inner = caller, None
        while f is not None:
            code = f.f_code
            if inner is None and not code.co_filename.startswith(TORCH_DIR) and (
                    not forward_only or code.co_name == "forward" or
                    (code.co_filename, code.co_name) in anchors):
                inner = (code.co_filename, f.f_lineno, code.co_name)
                if forward_only:
                    break
            if inner is not None and code.co_name == "forward":
                break
            f = f.f_back
        else:
            inner = None  # no `forward` at or outside it: FX keeps no frame
        return _InnermostFrame(inner)

    def summary(self) -> traceback.StackSummary:
        if self.frame is None:
            return traceback.StackSummary()
        return traceback.StackSummary.from_list([traceback.FrameSummary(*self.frame)])


@contextlib.contextmanager
def watch_backward_runs(refuse):
    """Within: a backward pass run from Python (`loss.backward()`, `torch.autograd.grad`)
    calls `refuse()` first (which raises, or returns to let it run)."""
    import torch.autograd as autograd

    names = ["_engine_run_backward"] if hasattr(autograd, "_engine_run_backward") else \
        ["backward", "grad"]
    originals = {name: getattr(autograd, name) for name in names}

    def watched(original):
        def run(*args, **kwargs):
            refuse()
            return original(*args, **kwargs)
        return run

    for name, original in originals.items():
        setattr(autograd, name, watched(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(autograd, name, original)


def shares_storage(a, b) -> bool:
    """Whether tensors `a` and `b` (fake ones included: a traced node's value) use the same
    storage: a view of the other, where an op that may alias (reshape, contiguous, to)
    returned its input's storage rather than a copy."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata
