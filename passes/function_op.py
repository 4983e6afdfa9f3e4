"""A custom `torch.autograd.Function` kept in the traced program as one op that runs the
Function's own forward and backward.

torch.export inlines a Function's `forward` and autograd would differentiate what it finds
there, never running the Function's `backward` (a straight-through estimator's gradient would
be off by its own size, gradient reversal's of the wrong sign). While autopar traces, a call
`Fn.apply(*args)` becomes `autopar::autograd_function(key, args, tensors)` instead
(passes/soundness.py makes the swap): a custom op whose implementation calls `Fn.forward`
(with a context of its own, as torch gives one) and whose registered backward calls
`Fn.backward` with that same context, so saved tensors and attributes set in forward are
what backward reads, as on one device. The graph keeps the op; without a sharding rule it
runs whole on every rank (its inputs gathered), which is exact whatever the Function does.

`key` names the Function's class by module and qualified name (it is imported again where
the program runs), `args` is the call's non-tensor arguments (pickled, base64) with the
tensors' places marked. A Function that cannot be named so (defined inside a function),
whose arguments do not pickle, or whose forward returns anything but tensors is refused by
`capturable`'s reason.
"""

from __future__ import annotations

import base64
import importlib
import pickle
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_LOCAL = threading.local()  # the context of the forward that ran last, for setup_context


class _Tensor:
    """Where a tensor argument stood in the call (pickled in its place)."""

    def __init__(self, index: int):
        self.index = index


class FunctionContext:
    """The `ctx` a Function's forward and backward receive: saved tensors, the inputs that
    need a gradient, whatever attributes forward sets."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True
        self.non_differentiable: tuple = ()
        self.dirty: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        self.non_differentiable = tensors

    def mark_dirty(self, *tensors) -> None:
        self.dirty = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def function_key(cls: type) -> str:
    """The name the op carries for `cls`: module and qualified name."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve(key: str) -> type:
    """The Function class `key` names."""
    module, _, qualname = key.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def capturable(cls: type, args: tuple, kwargs: dict) -> str:
    """Why `cls.apply(*args, **kwargs)` cannot be kept as the op, or ""."""
    if kwargs:
        return "it is called with keyword arguments"
    if "<locals>" in cls.__qualname__:
        return "its class is defined inside a function (define it at module level)"
    try:
        if resolve(function_key(cls)) is not cls:
            return "its class is not found under its own name"
    except (ImportError, AttributeError):
        return "its class is not found under its own name"
    if not any(isinstance(a, torch.Tensor) for a in args):
        return "it is called without tensor arguments"
    try:
        encode(args)
    except Exception:  # noqa: BLE001 - any pickling failure means the same
        return "its non-tensor arguments do not pickle"
    return ""


def encode(args: tuple) -> tuple[str, list[torch.Tensor]]:
    """The call's arguments as (its non-tensor arguments with the tensors' places marked,
    pickled in base64; the tensors)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    marked, k = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            marked.append(_Tensor(k))
            k += 1
        else:
            marked.append(a)
    return base64.b64encode(pickle.dumps(marked)).decode(), tensors


def _decode(args: str, tensors: list[torch.Tensor]) -> list:
    marked = pickle.loads(base64.b64decode(args))
    return [tensors[a.index] if isinstance(a, _Tensor) else a for a in marked]


def call(cls: type, args: tuple):
    """`cls.apply(*args)` as the op (while tracing); returns what apply returns."""
    encoded, tensors = encode(args)
    outs = torch.ops.autopar.autograd_function(function_key(cls), encoded, tensors)
    return outs[0] if _returns_one(cls, args) else tuple(outs)


def _returns_one(cls: type, args: tuple) -> bool:
    return getattr(_LOCAL, "single", {}).get(function_key(cls), True)


@torch.library.custom_op("autopar::autograd_function", mutates_args=())
def autograd_function(key: str, args: str, tensors: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
    """Run the Function `key` names on its arguments: its forward's outputs (fresh tensors:
    an output that is one of its inputs or a view of one is copied)."""
    outs = _forward(key, args, tensors)
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    return [o.clone() if o.untyped_storage().data_ptr() in inputs else o for o in outs]


def _forward(key: str, args: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of the Function's forward on the op's arguments; its context is handed to
    `_setup_context` (`_LOCAL.ctx`), and why it cannot be kept as the op to `problem`."""
    fn = resolve(key)
    values = _decode(args, tensors)
    ctx = FunctionContext(tuple(isinstance(v, torch.Tensor) for v in values))
    with _Draws() as draws:
        if _has_setup_context(fn):
            out = fn.forward(*values)
            fn.setup_context(ctx, tuple(values), out)
        else:
            out = fn.forward(ctx, *values)
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"the autograd.Function {key} returned {type(out).__name__} holding "
                        "other values than tensors; autopar keeps Functions returning tensors")
    if not hasattr(_LOCAL, "single"):
        _LOCAL.single = {}
    _LOCAL.single[key] = single
    _LOCAL.ctx = ctx
    _LOCAL.problem = (
        "its forward draws random numbers (one device's draws could not be kept in step)"
        if draws.drew else
        "its forward writes into an input (ctx.mark_dirty)" if ctx.dirty else "")
    return outs


class _Draws(TorchDispatchMode):
    """Notes whether the ops run under it draw random numbers."""

    drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.drew = True
        return func(*args, **(kwargs or {}))


@autograd_function.register_fake
def _fake(key: str, args: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = _forward(key, args, tensors)
    return [torch.empty_like(o) for o in outs]


def problem() -> str:
    """Why the Function the op last traced cannot be kept as the op after all (its forward
    draws random numbers, or writes into an input), or ""."""
    return getattr(_LOCAL, "problem", "")


def _has_setup_context(fn: type) -> bool:
    return fn.setup_context is not torch.autograd.Function.setup_context


def _setup_context(ctx, inputs, output) -> None:
    key, args, tensors = inputs
    user = getattr(_LOCAL, "ctx", None)
    _LOCAL.ctx = None
    user.needs_input_grad = tuple(
        v.requires_grad if isinstance(v, torch.Tensor) else False
        for v in _decode(args, list(tensors)))
    ctx.user, ctx.key, ctx.args, ctx.n = user, key, args, len(tensors)
    ctx.shapes = [(o.shape, o.dtype, o.device) for o in output]


def _backward(ctx, grads):
    fn, user = resolve(ctx.key), ctx.user
    grads = list(grads)
    if user.materialize_grads:
        grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g
                 for g, (s, d, dev) in zip(grads, ctx.shapes)]
    got = fn.backward(user, *grads)
    got = got if isinstance(got, tuple) else (got,)
    marked = pickle.loads(base64.b64decode(ctx.args))
    out: list = [None] * ctx.n
    for g, a in zip(got, marked):
        if isinstance(a, _Tensor):
            out[a.index] = g
    return None, None, out


autograd_function.register_autograd(_backward, setup_context=_setup_context)
