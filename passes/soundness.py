"""What torch.export would lose of a model's forward: each construct captured, or refused.

Non-strict torch.export runs forward's Python once and records the ATen ops it reaches; autopar
then runs that graph, and lets autograd differentiate it. Whatever forward does outside those
ops, or does to autograd itself, is lost without a word, and the model would train differently
than on one device. `SoundnessGate` watches the export of the model (passes/trace.py `_export`,
beside the watch on the model's attributes, passes/side_effects.py) and refuses each such
construct by calling `refuse(why)` (which raises TraceError), naming the construct, where the
model runs it (its module and source line) and what to do instead. The verdicts:

- a custom `torch.autograd.Function` (a straight-through estimator, gradient reversal, Bloom's
  GeLU): CAPTURED as one op of the graph that runs its own forward and backward
  (passes/function_op.py); REFUSED where it cannot be (a class defined inside a function,
  arguments that do not pickle, outputs other than tensors, a forward that draws random
  numbers or writes into its input): the trace would inline its
  `forward`, autograd would differentiate that, and its `backward` would never run.
  torch's own Functions (`__module__` under `torch.`: custom_op's, checkpoint's) run as they
  are.
- a gradient hook registered on a tensor in forward (`Tensor.register_hook`,
  `register_post_accumulate_grad_hook`): REFUSED; the graph keeps no hooks. Transform the
  gradients after `step()` returns.
- a backward pass in forward (`torch.autograd.grad`, however imported, or `.backward()`: a
  gradient penalty): REFUSED; the trace runs it on fake tensors once and keeps no gradient
  program. Not supported inside forward.
- Python randomness (`random`'s global generator, numpy's global legacy generator, and a
  `random.Random`, `numpy.random.RandomState` or `numpy.random.Generator` held as an attribute
  of a module or named as a global by a module's forward): REFUSED when forward draws from it
  (its state changed across the export), naming the innermost module whose forward drew. The
  draw is frozen in the graph: every step would reuse the first one. Draw with torch ops
  (`torch.rand(())`, `torch.distributions.Beta(...).sample()`) so that the draw is part of the
  program, or draw in the training loop and pass the value in as a tensor input.
- reseeding torch's generator in forward (`torch.manual_seed`, `torch.seed`,
  `torch.set_rng_state`, called from the model's code): REFUSED; the graph would never reseed.
  Seed in the training loop.
- a `torch.Generator` of the model's own (`torch.rand(..., generator=g)`, g held by a module
  or a global): REFUSED (torch.export lifts it as an object autopar cannot run, and could not
  keep its draws in step with one device's). Draw from torch's default generator (autopar
  draws each rank's block of what one device draws).
- a global value written in forward or the loss function (a module-level counter, a list
  appended to, a plain value the forward of a module class, the loss function or a function
  they call reads and rebinds: what passes/trace_values.py fingerprints): REFUSED,
  naming the global; the graph never repeats the write. Keep such state out of forward.
  (Attributes of the model's modules: passes/side_effects.py.)

Captured already, elsewhere (listed so that this docstring is the whole list):

- `torch.no_grad()` / `torch.enable_grad()` regions: CAPTURED (export wraps them in
  `wrap_with_set_grad_enabled`; passes/trace.py inlines them, detaching what crosses a no-grad
  region); an enabled `torch.autocast` region: REFUSED there.
- `.item()` / `.tolist()` driving a Python branch or a size: REFUSED by export as
  data-dependent control flow or shape (passes/trace.py names the line).
- `torch.utils.checkpoint`: non-reentrant CAPTURED, reentrant REFUSED (torch_compat
  `watch_checkpoints`).
- `torch.library.custom_op` with `register_autograd`: CAPTURED (an op of the graph whose
  backward is the registered one).
- dropout and torch's random ops: CAPTURED (ops of the graph; the runtime draws what one
  device draws: eager PyTorch's numbers, or in counter randomness autopar's).

The gate costs a few dictionary look-ups per module call while tracing, reading the states of
the Python generators a model can reach before and after the forward of each of its modules
that is not torch's own (numpy's global generator is the dear one: about 0.1 ms a read), and
reading forward's globals at its start and end: 9 ms of a 0.5 s trace of a 2-layer Hugging
Face Llama, 45 ms of 3.3 s unfolded at 16 layers.
"""

from __future__ import annotations

import linecache
import os
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind

from .function_op import call as call_function_op
from .function_op import capturable
from .function_op import problem as function_op_problem
from .torch_compat import TORCH_DIR, watch_backward_runs
from .trace_values import changed, forward_classes, forward_values, loss_values

# frames of the gate itself, skipped when finding the model's line
_HERE = {os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
         for name in ("soundness.py", "torch_compat.py")}


class SoundnessGate:
    """Within: the export of `root` refuses (calls `refuse(why)`, which raises) what it would
    lose of forward (see the module docstring). `prefix` is prepended to module paths in
    messages (as SideEffectWatch's); `check(ep)` refuses what shows only in the export's
    result (a torch.Generator lifted as an input)."""

    def __init__(self, root: nn.Module, prefix: str, refuse: Callable[[str], Any]):
        self.root, self.prefix, self.refuse = root, prefix, refuse
        self.paths = {id(m): path for path, m in root.named_modules(remove_duplicate=False)}
        # torch's own modules (Linear, Embedding...) draw no Python random numbers: their
        # generator states are not read (what a user's module around them draws is)
        self.drawing = {id(m) for m in root.modules()
                        if not type(m).__module__.startswith("torch.")}
        self.stack: list[str] = []  # module paths of the forwards running, innermost last
        self.states: list[list] = []  # generator states at each running forward's start
        self.generators = _python_generators(root)
        self.classes = forward_classes(root)
        # the loss function the tracing wrapper calls (passes/trace.py `_Step.loss_fn`)
        self.loss_fn = getattr(root, "loss_fn", None)
        self._undo: list[Callable[[], None]] = []

    # -- entering and leaving ------------------------------------------------------------------

    def __enter__(self) -> SoundnessGate:
        self.thread = threading.get_ident()  # other threads run as they would
        hooks = torch.nn.modules.module
        self._undo = [
            hooks.register_module_forward_pre_hook(self._pre).remove,
            hooks.register_module_forward_hook(self._post).remove,
            _replace(torch.autograd.Function, "apply", classmethod(self._apply)),
            *(_replace(owner, name, self._reseed(owner, name))
              for owner in (torch, torch.random)
              for name in ("manual_seed", "seed", "set_rng_state")),
            _replace(torch.Tensor, "register_hook", self._hook("register_hook")),
            _replace(torch.Tensor, "register_post_accumulate_grad_hook",
                     self._hook("register_post_accumulate_grad_hook")),
        ]
        backward = watch_backward_runs(self._backward)
        backward.__enter__()
        self._undo.append(lambda: backward.__exit__(None, None, None))
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    # -- module forwards: where the model is, and what its forward drew -------------------------

    def _pre(self, module: nn.Module, args) -> None:
        path = self.paths.get(id(module))
        if path is None or threading.get_ident() != self.thread:
            return
        if not self.stack:  # the root's forward begins
            self.globals_before = self._globals()
            self.seed = torch.initial_seed()
        self.stack.append(path)
        self.states.append([_state(g) for _, g in self.generators]
                           if id(module) in self.drawing else None)

    def _post(self, module: nn.Module, args, output) -> None:
        if self.paths.get(id(module)) is None or not self._tracing():
            return
        before = self.states.pop()
        for (label, g), old in zip(self.generators, before or ()):
            if _state(g) != old:
                code = getattr(type(module).forward, "__code__", None)
                at = f" (its forward at {code.co_filename}:{code.co_firstlineno})" if code \
                    else ""
                self.refuse(
                    f"forward draws a Python random number from {label} in "
                    f"{self._where(line=False)}{at}: the trace "
                    "keeps the value drawn while tracing as a constant, so every step would "
                    "reuse that one draw. Draw with torch ops on tensors (torch.rand, "
                    "torch.bernoulli, torch.distributions...sample()) so that the draw is part "
                    "of the program, or draw in the training loop and pass the value in as a "
                    "tensor input")
        self.stack.pop()
        if self.stack:
            return
        if torch.initial_seed() != self.seed:  # the root's forward ends
            self.refuse(
                "forward reseeds torch's random generator (torch.manual_seed or "
                "torch.seed): the traced program would never reseed it. Seed in the training "
                "loop, before step()")
        writes = _global_writes(self.globals_before, self._globals())
        if writes:
            self.refuse(
                "forward changed global Python state during tracing:\n  " +
                "\n  ".join(writes[:5]) +
                "\nautopar runs the traced graph, which does not repeat Python side effects: "
                "the change happened once, while tracing. Keep counters, logs and caches out "
                "of forward (in the training loop), or compute the value with tensor ops and "
                "return it from forward")

    def _globals(self):
        """The plain values forward and the loss function read besides the modules'
        attributes (passes/trace_values.py), as they are now."""
        read = forward_values(self.classes)
        return read if self.loss_fn is None else read + loss_values(self.loss_fn)

    def _tracing(self) -> bool:
        """Whether the root's forward is running, in the thread that exports it."""
        return bool(self.stack) and threading.get_ident() == self.thread

    def _where(self, line: bool = True) -> str:
        """The module running now ("module model.fc (Linear)"; "the loss function" for the
        tracing wrapper's own code) and, with `line`, the model's source line running now."""
        path = self.stack[-1] if self.stack else ""
        full = ".".join(p for p in (self.prefix.rstrip("."), path) if p)
        if not full:
            what = "the loss function (or the tracing wrapper)"
        else:
            module = self.root.get_submodule(path) if path else self.root
            what = f"module {full} ({type(module).__name__})"
        at = user_line() if line else ""
        return f"{what}{f' at {at}' if at else ''}"

    # -- what forward does to autograd ----------------------------------------------------------

    def _apply(self, cls, *args, **kwargs):
        if self._tracing() and not (cls.__module__ or "").startswith("torch."):
            why = capturable(cls, args, kwargs)
            if not why:
                out = call_function_op(cls, args)
                why = function_op_problem()
                if not why:
                    return out
            self.refuse(
                f"forward calls the custom autograd.Function {cls.__qualname__} in "
                f"{self._where()}, which autopar cannot keep as one op: {why}. Traced as it "
                "is, its forward would be inlined and differentiated by autograd, so its "
                "backward would never run. Or register the op with torch.library.custom_op, "
                "with register_fake and register_autograd (its backward)")
        return _ORIGINAL_APPLY(cls, *args, **kwargs)

    def _hook(self, name: str):
        original = getattr(torch.Tensor, name)

        def hook(tensor, fn, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self._tracing() and not caller.startswith(TORCH_DIR):
                self.refuse(
                    f"forward registers a gradient hook (Tensor.{name}) in {self._where()}: "
                    "the traced program keeps no hooks, so it would never run. Transform the "
                    "gradients after step() returns (p.grad is complete then)")
            return original(tensor, fn, *args, **kwargs)

        return hook

    def _reseed(self, owner, name: str):
        original = getattr(owner, name)

        def reseed(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self._tracing() and not caller.startswith(TORCH_DIR):
                self.refuse(
                    f"forward reseeds torch's random generator (torch.{name}) in "
                    f"{self._where()}: the traced program would never reseed it (every step "
                    "would draw on from where the last left). Seed in the training loop, "
                    "before step()")
            return original(*args, **kwargs)

        return reseed

    def _backward(self) -> None:
        if self._tracing():
            self.refuse(
                f"forward runs a backward pass (torch.autograd.grad or .backward()) in "
                f"{self._where()}: the trace runs it once on fake tensors and keeps no "
                "gradient program, so the result would be wrong. Gradients inside forward "
                "(gradient penalties, inner optimization steps) are not supported; compute "
                "the model's loss without them")

    # -- what shows in the export ---------------------------------------------------------------

    def check(self, ep, line_of: Callable[[Any], str]) -> None:
        """Refuse a torch.Generator the export lifted as an input of the program (naming the
        model line `line_of` a node gives)."""
        for spec in ep.graph_signature.input_specs:
            if spec.kind != InputKind.CUSTOM_OBJ:
                continue
            obj = ep.constants.get(spec.target)
            if not isinstance(obj, torch.Generator):
                continue
            node = next((n for n in ep.graph.nodes if n.name == spec.arg.name), None)
            users = list(node.users) if node is not None else []
            line = next((line_of(u) for u in users if line_of(u)), "")
            self.refuse(
                "forward draws random numbers from a torch.Generator of its own "
                f"(generator=...){f' at {line}' if line else ''}: autopar draws from torch's "
                "default generator only (each rank its block of what one device draws). Drop "
                "the generator= argument and seed torch's generator in the training loop")


_ORIGINAL_APPLY = torch.autograd.Function.apply.__func__


def _replace(owner, name: str, value) -> Callable[[], None]:
    """Set `owner.name` to `value`; returns what puts the original back."""
    original = owner.__dict__[name]
    setattr(owner, name, value)
    return lambda: setattr(owner, name, original)


def user_line() -> str:
    """The innermost frame of the Python stack outside torch and this gate, as
    "file:line: code" (the model's line), or ""."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(TORCH_DIR) and os.path.abspath(name) not in _HERE and \
                not name.startswith("<"):
            code = linecache.getline(name, f.f_lineno).strip()
            return f"{name}:{f.f_lineno}: {code}"
        f = f.f_back
    return ""


def _global_writes(before, after) -> list[str]:
    """What changed between two `forward_values` fingerprints, one line per global."""
    now = dict(after)
    out = [f"global {line}" for line in changed(before, tuple(
        (label, value) for label, value in after if label in dict(before)))]
    out += [f"global {label} was {value[0] if len(value) == 1 else value!r}, and is now a "
            "value of another kind" for label, value in before if label not in now]
    return out


# -- Python generators -----------------------------------------------------------------------------

def _is_generator(value: Any) -> bool:
    if isinstance(value, random.Random):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.random.RandomState, np.random.Generator))


def _python_generators(root: nn.Module) -> list[tuple[str, Any]]:
    """(label, generator) for the Python generators `root`'s forward can draw from: the
    global ones of `random` and numpy, those its modules hold as attributes, and those the
    forward of its module classes names as globals."""
    out: list[tuple[str, Any]] = [("Python's random module", random)]
    np = sys.modules.get("numpy")
    if np is not None:
        out.append(("numpy.random (its global generator)", np.random))
    seen = {id(g) for _, g in out}
    for path, m in root.named_modules():
        found = [(f"{path or type(m).__name__}.{n}", v) for n, v in vars(m).items()
                 if _is_generator(v)]
        forward = getattr(type(m).forward, "__code__", None)
        if forward is not None:
            scope = type(m).forward.__globals__
            found += [(f"the global {n}", scope[n]) for n in forward.co_names
                      if n in scope and _is_generator(scope[n])]
        for label, g in found:
            if id(g) not in seen:
                seen.add(id(g))
                out.append((label, g))
    return out


def _state(g: Any) -> Any:
    """A comparable copy of generator `g`'s state (`random` or numpy.random: the global
    ones)."""
    if g is random or isinstance(g, random.Random):
        try:
            return g.getstate()
        except NotImplementedError:  # SystemRandom: no state, nothing to compare
            return None
    np = sys.modules["numpy"]
    if isinstance(g, np.random.Generator):
        return _frozen(g.bit_generator.state)
    return _frozen(g.get_state(legacy=False))  # numpy.random or a RandomState


def _frozen(value: Any) -> Any:
    """`value` (a numpy generator's state: dicts, numbers, arrays) as comparable tuples."""
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if hasattr(value, "tobytes"):
        return value.tobytes()
    return value
