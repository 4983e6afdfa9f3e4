"""Guards on the Python values a parallelized model's programs were traced with.

A program holds what its trace read as constants (passes/trace_values.py). `ValueGuards` keeps
those values current for a `Parallelized` model: its module tree mirrors the model's plain
attributes, so `pmodel.drop.p = 0.0` or `pmodel.scale = 2.0` set what the next trace reads; the
fingerprint of the values the traces read (module attributes, the globals and closures of
forward and of the loss function) is part of the key a program is found by, so a changed value
traces the model again;
tensors the loss function captured are copied into the programs again when changed in place.
A value changing at every step would trace at every step: after `MAX_VALUE_SETS` different
fingerprints the call is refused, saying which values changed and what to do instead.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

from autopar.passes.trace_values import (
    Fingerprint,
    attribute_reads,
    changed,
    config_value,
    forward_classes,
    forward_values,
    is_config,
    loss_values,
    plain_value,
    public_values,
    reads_object,
    watched,
)

MAX_VALUE_SETS = 8


def _module(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _plain(value):
    """A watched attribute's fingerprint entry: a configuration object's by its fields, one
    set to something else than a plain value by its type's name (the same on every rank)."""
    if is_config(value):
        return config_value(value)
    entry = plain_value(value)
    return entry if entry is not None else ("not a plain value", type(value).__name__)


def _configs(module: nn.Module) -> dict:
    """A module's public configuration objects (`is_config`) by attribute name."""
    return {n: v for n, v in vars(module).items() if not n.startswith("_") and is_config(v)}


def put_back(kept: torch.Tensor, now, what: str) -> str | None:
    """`now`, what the user assigned in place of `kept` (a tensor the programs read), gives
    `kept` its values (the caller puts `kept` back in its place); an error message naming
    `what` when it cannot (not a tensor, or another shape or dtype)."""
    if not isinstance(now, torch.Tensor) or now.shape != kept.shape or now.dtype != kept.dtype:
        got = f"a {tuple(now.shape)} {now.dtype} tensor" if isinstance(now, torch.Tensor) \
            else type(now).__name__
        return (f"{what} ({tuple(kept.shape)} {kept.dtype}) was replaced by {got} after "
                "parallelize; the programs were planned for its shape and dtype. Change its "
                "values in place, or parallelize the model again")
    with torch.no_grad():
        kept.copy_(now)
    return None


class ValueGuards:
    """The traced values of one parallelized model (see the module docstring)."""

    def __init__(self, model: nn.Module, tree: nn.Module, loss_fn):
        """Mirror `model`'s plain public attributes onto `tree` (the parallelized model, which
        holds the model's module tree), except names `tree`'s root already has; `model` is
        the copy the programs are traced from: its plain tensor attributes and its
        configuration objects (`pmodel.config`) are mirrored as themselves (the programs lift
        the tensors as constants; a configuration's fields set through `tree` are the traced
        copy's)."""
        self.loss_fn = loss_fn
        self.tree = weakref.ref(tree)
        self.classes = forward_classes(model)  # whose forward's globals are watched
        self.root_names: list[str] = []
        self.tensors: list[tuple[nn.Module, str, torch.Tensor]] = []  # mirrored tensors
        for path, m in model.named_modules():
            target = _module(tree, path)
            tensors = {n: v for n, v in vars(m).items() if not n.startswith("_") and
                       isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}
            for name, value in [*public_values(m).items(), *tensors.items(),
                                *_configs(m).items()]:
                if not path:
                    if hasattr(tree, name):
                        continue
                    self.root_names.append(name)
                setattr(target, name, value)
                if name in tensors:
                    self.tensors.append((target, name, value))
        self.pairs: list[tuple[str, str]] = []  # (module path, attribute) a trace read
        self.resolved: list | None = None  # (label, module of the tree, attribute) per pair
        self.seen: list[Fingerprint] = []
        self.lifted: list[list] = []  # [the user's tensor, the program's copy, its version]
        self.ordinals: dict[int, int] = {}  # id of a tensor the loss reads -> first-seen order

    def fingerprint(self, tree: nn.Module) -> Fingerprint:
        """The values the traces read, as they are now."""
        if self.resolved is None:  # the modules, found once for the pairs known
            self.resolved = [(f"{path or 'model'}.{name}", _module(tree, path), name)
                             for path, name in self.pairs]
        out = [(label, _plain(getattr(m, name, None))) for label, m, name in self.resolved]
        read = list(forward_values(self.classes))
        if self.loss_fn is not None:
            read += loss_values(self.loss_fn)
        out += [(label, self._same_on_ranks(v)) for label, v in read]
        return tuple(out)

    def _same_on_ranks(self, value):
        """A tensor's entry by the order this model first saw it in, not by its id (which
        differs between ranks; the key is compared among them). The program holds a lifted
        tensor, so its id stays its own while it matters."""
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
            return ("tensor", self.ordinals.setdefault(value[1], len(self.ordinals)))
        return value

    def check(self, fingerprint: Fingerprint) -> str | None:
        """An error message when this fingerprint would be one too many to trace for, or
        when the loss function reads the parallelized model (checked before each trace)."""
        reads_tree = self._loss_reads_tree()
        if reads_tree:
            return reads_tree
        if fingerprint in self.seen or len(self.seen) < MAX_VALUE_SETS:
            return None
        lines = changed(self.seen[0], fingerprint)
        return (f"values the model's programs were traced with changed {len(self.seen)} "
                "times (" + "; ".join(lines[:4]) + "); autopar traces and plans the model "
                "again for each new value, as a compiler would. For a value that changes "
                "during training, hold it in a tensor and change that in place: a buffer of "
                "the model (register_buffer, changed through the parallelized model) or a "
                "tensor the loss function captures (coef.fill_(value)); both are read at "
                "every step")

    def _loss_reads_tree(self) -> str | None:
        """An error message when the loss function reads the parallelized model, one of its
        modules or parameters: they hold this rank's shards, which the traced loss cannot
        differentiate (and no parameters before the first build)."""
        tree = self.tree()
        if self.loss_fn is None or tree is None:
            return None
        modules = list(tree.modules())
        held = {id(v) for m in modules for v in [m, *m._parameters.values()]}
        where = reads_object(self.loss_fn, lambda v: id(v) in held)
        if where is None:
            return None
        return (f"the loss function reads the parallelized model ({where}): its modules "
                "hold this rank's shards of the parameters (none before the first call), "
                "which the traced loss cannot use. Read the model you passed to "
                "parallelize instead (with `pmodel = autopar.parallelize(model, ...)`, read "
                "model.fc.weight, not pmodel.fc.weight: the loss is traced with it), or "
                "compute the term in the model's forward")

    def remember(self, fingerprint: Fingerprint) -> None:
        """A program was built for these values."""
        if fingerprint not in self.seen:
            self.seen.append(fingerprint)

    def sync(self, tree: nn.Module, traced: nn.Module) -> None:
        """Before a trace: the traced copy takes the values set on the parallelized model."""
        for path, m in tree.named_modules():
            target = _module(traced, path)
            if target is None:
                continue
            names = self.root_names if not path else [*public_values(m), *_configs(m)]
            for name in names:
                if name in vars(target):
                    setattr(target, name, getattr(m, name))

    @contextlib.contextmanager
    def reading(self, traced: nn.Module):
        """Around a trace of `traced`: adds what its forward read to the watched values."""
        with attribute_reads() as reads:
            yield
        for pair in watched(traced, reads):
            if pair not in self.pairs:
                self.pairs.append(pair)
                self.resolved = None

    def follow(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        """`copy`, a program's constant, is to follow `source`, the tensor the trace lifted."""
        self.lifted.append([source, copy, source._version])

    def rebound(self) -> str | None:
        """A tensor attribute replaced on the parallelized model (`pmodel.temperature =
        torch.tensor(2.0)`): its values are copied into the tensor the programs lifted, which
        takes its place again; an error message when they cannot be (another shape or
        dtype, or not a tensor)."""
        for owner, name, tensor in self.tensors:
            now = getattr(owner, name, None)
            if now is not tensor:
                error = put_back(tensor, now, f"tensor attribute {name} of "
                                              f"{type(owner).__name__}")
                if error:
                    return error
                setattr(owner, name, tensor)
        return None

    def refresh(self) -> list[torch.Tensor]:
        """Copies again every lifted tensor changed in place since; returns those sources
        (their values must agree among ranks)."""
        moved = []
        for entry in self.lifted:
            source, copy, version = entry
            if source._version != version:
                with torch.no_grad():
                    copy.copy_(source)
                entry[2] = source._version
                moved.append(source)
        return moved
