"""Python side effects of forward during tracing: state a traced graph would never update again.

Non-strict torch.export runs forward's Python once. Whatever forward does to the model's Python
attributes (a call counter, a list it appends to, a cached value) happens at tracing only; the
graph autopar runs afterwards repeats the tensor ops, not the Python. torch.export also puts those
attributes back as they were after tracing, so the change is only visible while forward runs:
`SideEffectWatch` compares every module's attributes just before and just after the root
module's forward, from forward hooks, and reports what changed. `replay` sets them as forward
left them, so that a second trace can tell a change made once for good (a setting derived from
the input's shape) from one made at every call (passes/trace.py).

The comparison is shallow: a value counts as changed when it is rebound to another object (equal
numbers and strings are the same value), and a list, tuple, dict or set also when its items (by
identity) change in place. Objects reached through an attribute (a config's fields, say) are not
inspected.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

# nn.Module's own machinery: hook tables and the registries of parameters, buffers and
# submodules (those have their own checks: export reports buffer updates as mutations). The same
# list torch.export leaves out of its attribute-assignment check.
MODULE_INTERNALS = frozenset({
    "_backward_hooks", "_backward_pre_hooks", "_buffers", "_forward_hooks",
    "_forward_hooks_always_called", "_forward_hooks_with_kwargs", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook", "_load_state_dict_post_hooks",
    "_load_state_dict_pre_hooks", "_modules", "_non_persistent_buffers_set", "_parameters",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_initialize_hook", "_load_hook",
})

# Caches torch rebuilds from a module's parameters when forward finds them swapped (an RNN lists
# its weights again at every forward under torch.func.functional_call and torch.export, which
# replace the parameters while tracing): not state of the model. torch.export warns about the
# tensors an RNN so assigns; the watch silences that warning.
DERIVED = {nn.RNNBase: frozenset({"_flat_weights", "_flat_weight_refs"})}
_DERIVED_WARNING = (r"The tensor attributes (\S+\._flat_weights\[\d+\], )*"
                    r"\S+\._flat_weights\[\d+\] were assigned during export")

_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_UNSET = object()


class SideEffectWatch:
    """Watches `root`'s forward while torch.export traces it; `changes()` lists, after tracing,
    what forward changed, as lines naming `prefix + module path + attribute`."""

    def __init__(self, root: nn.Module, prefix: str = ""):
        self.root, self.prefix = root, prefix
        self._before: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._changes: list[str] = []
        self._left: dict[tuple[str, str], Any] = {}  # what forward left each changed attribute
        self._handles: list[Any] = []

    def __enter__(self) -> SideEffectWatch:
        self._handles = [
            self.root.register_forward_pre_hook(self._pre, prepend=True),
            self.root.register_forward_hook(self._post),
        ]
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", _DERIVED_WARNING, UserWarning)
        return self

    def __exit__(self, *exc) -> None:
        self._warnings.__exit__(*exc)
        for h in self._handles:
            h.remove()

    def changes(self) -> list[str]:
        """One line per attribute forward changed (empty when none did)."""
        return list(self._changes)

    def replay(self) -> None:
        """Set every attribute forward changed to what forward left it (what the first call
        of the model leaves): export puts them back as they were."""
        modules = dict(self.root.named_modules(remove_duplicate=False))
        for (path, name), value in self._left.items():
            _put(modules[path], name, value)

    def replay_onto(self, other: nn.Module, under: str):
        """Set the same changes on `other`, the module that the watched root's module at path
        `under` copies (the user's model, which a loss function may read); returns what puts
        `other` back as it was."""
        changes = [(other.get_submodule(path[len(under) + 1:]) if path != under else other,
                    name, value) for (path, name), value in self._left.items()
                   if path == under or path.startswith(under + ".")]
        undo = [(target, name, vars(target).get(name, _UNSET)) for target, name, _ in changes]
        for target, name, value in changes:
            _put(target, name, value)

        def restore() -> None:
            for target, name, old in reversed(undo):
                _put(target, name, old)
        return restore

    def left_tensors(self) -> bool:
        """Whether forward left a tensor (or a container holding one) in an attribute it
        changed: a value the graph keeps as a constant, which its code does not show."""
        return any(isinstance(v, torch.Tensor) or (
            isinstance(v, (list, tuple, dict, set, frozenset)) and any(
                isinstance(t, torch.Tensor) for t in (v.values() if isinstance(v, dict) else v)))
            for v in self._left.values())

    def _pre(self, module, args) -> None:
        self._before = _snapshot(self.root)

    def _post(self, module, args, output) -> None:
        after = _snapshot(self.root)
        for key in sorted(self._before.keys() | after.keys()):
            old, new = self._before.get(key, (_UNSET, None)), after.get(key, (_UNSET, None))
            if not _same(old, new):
                self._left[key] = new[0]
                path = ".".join(p for p in (self.prefix.rstrip("."), *key) if p)
                line = f"{path} {_how(old, new)}"
                if line not in self._changes:  # forward may run more than once
                    self._changes.append(line)


def _put(module: nn.Module, name: str, value: Any) -> None:
    if value is _UNSET:
        if name in vars(module):
            delattr(module, name)
    else:
        setattr(module, name, value)


def _snapshot(root: nn.Module) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(module path, attribute) -> (value, shallow fingerprint of its contents)."""
    out = {}
    for path, m in root.named_modules(remove_duplicate=False):
        derived = frozenset().union(*(names for kind, names in DERIVED.items()
                                      if isinstance(m, kind)))
        for name, value in vars(m).items():
            if name not in MODULE_INTERNALS and name not in derived and \
                    not isinstance(value, nn.Module):
                out[(path, name)] = (value, _contents(value))
    return out


def _contents(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(map(id, value))
    if isinstance(value, dict):
        return tuple((id(k), id(v)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return frozenset(map(id, value))
    return None


def _same(old: tuple[Any, Any], new: tuple[Any, Any]) -> bool:
    (a, a_items), (b, b_items) = old, new
    if a is _UNSET or b is _UNSET:
        return a is b
    if a is b:
        return a_items == b_items
    return _equal_scalars(a, b)


def _equal_scalars(a: Any, b: Any) -> bool:
    """Equal plain numbers and strings (or tuples of them) are the same value."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal_scalars(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and isinstance(a, _SCALARS) and a == b


def _how(old: tuple[Any, Any], new: tuple[Any, Any]) -> str:
    (a, a_items), (b, b_items) = old, new
    if a is _UNSET:
        return f"was set to {_show(b)}"
    if b is _UNSET:
        return f"was deleted (it was {_show(a)})"
    if a is b:
        return (f"was modified in place (a {type(a).__name__} of {_items(len(a_items))} before, "
                f"{_items(len(b_items))} after)")
    return f"changed from {_show(a)} to {_show(b)}"


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    if isinstance(value, tuple) and _equal_scalars(value, value) and len(text) <= 40:
        return text
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"a {type(value).__name__} of {_items(len(value))}"
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _items(n: int) -> str:
    return f"{n} item{'s' if n != 1 else ''}"
