"""The model passed to `autopar.parallelize`, which becomes the parallelized model, as FSDP2's
`fully_shard` and tensor parallel's `parallelize_module` work in place.

- At parallelize, its class becomes a subclass of its own (`become`, as FSDP2 does):
  `model(x)` is the parallelized model's inference call, `model.step` trains,
  `model.state_dict()` / `model.load_state_dict()` are the parallelized model's, and once built
  `model.parameters()` / `model.named_parameters()` are its parameters (this rank's shards).
  The model holds the parallelized model (dropping both frees it); copying it, pickling it or
  moving it (`.to()`) is the parallelized model's error.
- At the build (`Original.built`), each parameter and buffer of the model is replaced, on
  the module that holds it, by the parallelized model's tensor under the same name (tied ones
  stay tied): the model trains, and its full tensors are freed. Under a pipelined plan the
  parameters of other ranks' stages become meta tensors (shape and dtype, no values).
- An optimizer built over the model's parameters before the build would step the replaced
  tensors, which never get a gradient: a global optimizer step pre-hook refuses such a step on
  every rank (every rank builds the same optimizer), naming the parameter and what to build
  the optimizer over instead (`_refuse`).
- A mode set on the model (`model.eval()` before a validation pass) or a plain attribute
  (`model.drop.p = 0.0`) changed on it after parallelize: `Original.follow` applies such
  changes to the parallelized model, which then runs them as if set there. A buffer assigned
  anew on the model (`model.mask = new`) is copied into the one the programs read; a parameter
  assigned anew, or a hook registered on it after parallelize, is an error naming it.
- A loss function reading the model (`model.c.weight`, a buffer) reads, while traced, the
  traced copy's tensors (passes/trace.py `lent`): its terms are part of the program and
  differentiated, on the live tensors.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.passes.trace_values import plain_value, public_values

# id(parameter) -> (the parameter, weakly, its name): the model's parameters the build replaced
_REPLACED: dict[int, tuple[weakref.ref, str]] = {}
_HOOK = []  # the global pre-hook's handle, once registered
_KEY = "_autopar_parallelized"  # the model's attribute holding the parallelized model
_BUILT = "_autopar_built"  # set on the model once its tensors are the parallelized model's
_CLASSES: dict[type, type] = {}  # the model's class -> its parallelized subclass


def _replaced(named: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse optimizer steps over these parameters, which the build took off the model."""
    for key in [k for k, (p, _) in _REPLACED.items() if p() is None]:
        del _REPLACED[key]
    for name, p in named:
        _REPLACED[id(p)] = (weakref.ref(p), name)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))


def _refuse(optimizer, args, kwargs) -> None:
    """The pre-hook: raises when `optimizer` holds a parameter the build took off a model."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() would step parameter {entry[1]} of the "
                    "model passed to autopar.parallelize as it was before the build, which "
                    "replaced the model's parameters by the parallelized model's (this rank's "
                    "shards); this tensor never gets a gradient. Build the optimizer after the "
                    "build (parallelize with example_inputs=, or after the first step) over "
                    "model.parameters(), or model.named_parameters() for parameter groups by "
                    "name")


def _parallelized(model: nn.Module) -> nn.Module:
    return model.__dict__[_KEY]


def parallelized_of(model: nn.Module) -> nn.Module:
    """The parallelized model `model` became (`model` itself when it is not one)."""
    return _parallelized(model) if isinstance(model, ParallelizedModel) else model


class ParallelizedModel:
    """What the model passed to autopar.parallelize becomes (mixed into its class): the
    parallelized model's calls and state under the model's own object."""

    def __call__(self, *args, **kwargs):
        return _parallelized(self)(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The parallelized model's inference call (autopar.Parallelized.forward)."""
        return _parallelized(self)(*args, **kwargs)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward on the batch (autopar.Parallelized.step)."""
        return _parallelized(self).step(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The parallelized model's state: parameters as DTensors (this rank's shards)."""
        return _parallelized(self).state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads into the parallelized model (autopar.Parallelized.load_state_dict)."""
        return _parallelized(self).load_state_dict(state_dict, strict, assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """Once built, the parallelized model's (this rank's shards; under a pipelined plan
        its stages'); the model's own before."""
        if self.__dict__.get(_BUILT):
            return _parallelized(self).named_parameters(prefix, recurse, remove_duplicate)
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def __deepcopy__(self, memo):
        return _parallelized(self).__deepcopy__(memo)

    def __reduce_ex__(self, protocol):
        return _parallelized(self).__reduce_ex__(protocol)

    def _apply(self, fn, recurse: bool = True):
        return _parallelized(self)._apply(fn, recurse)


def fresh(model: nn.Module) -> None:
    """Check, before parallelizing `model`, that it is not a parallelized model already (a
    model whose earlier parallelized model never built is its own again)."""
    if isinstance(model, ParallelizedModel):
        if model.__dict__.get(_BUILT):
            raise ValueError(
                "this model was parallelized already: autopar.parallelize makes the model "
                "passed to it the parallelized model (its parameters are this rank's shards), "
                "as FSDP2's fully_shard does. Use it as it is, or parallelize a new model")
        release(model)


def release(model: nn.Module) -> None:
    """`model` is its own again, unless its tensors are the parallelized model's already
    (parallelize failed before its build)."""
    if isinstance(model, ParallelizedModel) and not model.__dict__.get(_BUILT):
        model.__class__ = type(model).__bases__[1]
        del model.__dict__[_KEY]


@contextlib.contextmanager
def as_given(model: nn.Module):
    """While the block runs (the build reading and initializing the model's tensors, module by
    module), `model` is of its own class again."""
    cls = type(model)
    if not issubclass(cls, ParallelizedModel):
        yield
        return
    model.__class__ = cls.__bases__[1]
    try:
        yield
    finally:
        model.__class__ = cls


def become(model: nn.Module, parallelized: nn.Module) -> None:
    """Make `model` (the model passed to parallelize) the parallelized model's own object: its
    class becomes a subclass with ParallelizedModel's methods, calling `parallelized`."""
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type("Parallelized" + cls.__name__, (ParallelizedModel, cls),
                             {"__module__": cls.__module__})
    model.__dict__[_KEY] = parallelized
    model.__class__ = _CLASSES[cls]


class Original:
    """The model passed to parallelize, followed weakly: its modes and plain attributes as
    last seen, and (after the build) the parallelized model's tensors it holds."""

    def __init__(self, model: nn.Module):
        """Snapshot `model` at parallelize."""
        self._model = weakref.ref(model)
        # per module, found once: [name, the module, its mode, hooks and plain attributes]
        self._modules = [[n, weakref.ref(m), m.training, _hooks(m),
                          {a: plain_value(v) for a, v in public_values(m).items()}]
                         for n, m in model.named_modules()]
        # (name, the module, "_parameters" or "_buffers", attribute, the tensor it holds)
        self._tensors: list[tuple[str, weakref.ref, str, str, torch.Tensor]] = []
        # (the tensor, weakly, its name): the model's own tensors at parallelize, by where
        # their storage starts (export lifts a captured parameter as a detached alias of it),
        # but those a module also holds as a plain attribute (forward may read them so)
        plain = {id(v) for m in model.modules() for v in vars(m).values()
                 if isinstance(v, torch.Tensor)}
        self._own = {t.data_ptr(): (weakref.ref(t), n)
                     for n, t in [*model.named_parameters(), *model.named_buffers()]
                     if not t.is_meta and t.numel() and id(t) not in plain}

    def model(self) -> nn.Module | None:
        """The model, while it lives."""
        return self._model()

    def captured(self, constants: dict[str, torch.Tensor]) -> str | None:
        """An error message when a traced program holds one of the model's own tensors as a
        constant: a loss function that captured the tensor itself (`w = model.c.weight`
        outside it) instead of reading it through the model while it runs (`lent`)."""
        for t in constants.values():
            entry = self._own.get(t.data_ptr()) if t.numel() else None
            own = entry[0]() if entry is not None else None
            if own is not None and own.shape == t.shape and own.dtype == t.dtype:
                return (f"the loss function captured {entry[1]} of the model passed to "
                        "autopar.parallelize as a tensor (taken from the model outside the "
                        "loss function): the program would keep it as a constant, while "
                        "the parallelized model trains and loads the model's tensors, which "
                        "its build replaces by this rank's shards. Read it through the model "
                        f"inside the loss function (model.{entry[1]}): it is traced then")
        return None

    def built(self, tree: nn.Module) -> None:
        """`tree` (the parallelized model) holds its parameters and buffers now: each of the
        model's is replaced by `tree`'s under the same name, or by a meta tensor where `tree`
        has none (another pipeline stage's); the ones replaced are freed unless held
        elsewhere (an optimizer over them refuses to step)."""
        model = self._model()
        if model is None:
            return
        if model.__dict__.get(_KEY) is not tree:
            raise RuntimeError("this model was parallelized again since this parallelized "
                               "model was made: use the latest one")
        live = {**dict(nn.Module.named_parameters(tree, remove_duplicate=False)),
                **dict(nn.Module.named_buffers(tree, remove_duplicate=False))}
        memo: dict[int, torch.Tensor] = {}  # tied parameters stay tied
        replaced = []
        for path, m in model.named_modules():
            for kind in ("_parameters", "_buffers"):
                entries = m.__dict__[kind]
                for attr, old in list(entries.items()):
                    if old is None:
                        continue
                    name = f"{path}.{attr}" if path else attr
                    new = live.get(name)
                    if new is None:
                        new = memo.get(id(old))
                    if new is None:
                        new = torch.empty_like(old, device="meta")
                        if isinstance(old, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=old.requires_grad)
                    memo[id(old)] = new
                    if new is not old and kind == "_parameters":
                        replaced.append((name, old))
                    entries[attr] = new
                    self._tensors.append((name, weakref.ref(m), kind, attr, new))
        model.__dict__[_BUILT] = True
        _replaced(replaced)

    def follow(self, tree: nn.Module) -> str | None:
        """Apply to `tree` (the parallelized model's module tree) the modes and plain
        attributes changed on the model since last seen, and a buffer assigned anew on it
        (copied into the one the programs read, by `tree`'s own check); an error message
        when one of its parameters was assigned anew, or a hook registered."""
        model = self._model()
        if model is None:
            return None
        for name, m, kind, attr, tensor in self._tensors:
            m = m()
            now = None if m is None else m.__dict__[kind].get(attr)
            if m is None or now is tensor:
                continue
            if kind == "_buffers":  # as if assigned on the parallelized model
                owner, last = name.rpartition(".")[0], name.rpartition(".")[2]
                target = _submodule(tree, owner)
                if target is not None and now is not None:
                    target._buffers[last] = now
                    m._buffers[attr] = tensor
                    continue
            return (f"{name} of the model passed to autopar.parallelize was assigned anew "
                    "after its build, which made the model's tensors the parallelized "
                    f"model's (this rank's shards); the programs read those. Change it in "
                    f"place (model.{name}.copy_(...) under torch.no_grad(), this rank's "
                    "shard) or load values with model.load_state_dict(...)")
        for entry in self._modules:
            name, m, mode, hooks, seen = entry[0], entry[1](), entry[2], entry[3], entry[4]
            if m is None:
                continue
            if _hooks(m) != hooks:
                return (f"a hook was registered on (or removed from) module "
                        f"{name or type(m).__name__} of the model passed to "
                        "autopar.parallelize after it; the parallelized model's programs were "
                        "traced with the hooks the model had at parallelize. Register hooks "
                        "(and call Hugging Face's gradient_checkpointing_enable(), which "
                        "registers one) before parallelize, or recompute with parallelize's "
                        "recompute=")
            target = None
            if m.training != mode:
                entry[2] = m.training
                target = _submodule(tree, name)
                if target is not None:
                    target.training = m.training
            for attr, value in seen.items():
                now = plain_value(vars(m).get(attr))
                if now is not None and now != value:
                    seen[attr] = now
                    target = target or _submodule(tree, name)
                    if target is not None and attr in vars(target):
                        setattr(target, attr, getattr(m, attr))
        return None


def _hooks(m: nn.Module) -> tuple:
    """The ids of a module's forward, pre-forward and backward hooks."""
    return tuple(tuple(d) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                    m._backward_pre_hooks))


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None
