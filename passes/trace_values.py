"""Python values a traced program holds as constants, and how to see them change.

Tracing runs the model's forward and the loss function's Python once. What that Python reads
becomes a constant of the graph: a module attribute forward reads (a Dropout's `p`, a scale
factor), a global or closure variable the loss function reads (a coefficient, a label
smoothing). On one device, changing one changes the next step; a traced program would keep the
old value. So the caller fingerprints these values at every call (`Fingerprint`) and traces
again when one changed:

- module attributes: `attribute_reads` records, while tracing, which plain values (numbers,
  strings, None, tuples of them) and configuration objects (a Hugging Face `config`, whose
  public plain fields count as one value) forward reads from which module classes; `watched`
  turns that into (module path, attribute) pairs of the model, read again at every call;
- the loss function: `loss_values` reads the closure variables, default arguments, the globals
  its code names, the plain attributes its code names on objects it reaches that way, and the
  plain attributes of a loss module (`nn.CrossEntropyLoss(label_smoothing=...)`), following
  the user's own functions it calls a few levels deep (`reads_object` finds an object it
  reads the same way);
- forward's globals: `forward_values` reads the same of the forward of each of the model's
  module classes (`forward_classes`): a global or closure value forward reads.

Tensors are fingerprinted by identity here: a tensor the loss function captures is lifted by
torch.export as a constant that is the user's tensor, and the runtime copies it again when its
version counter moves (an in-place change), so rebinding the name is what needs a new trace.
Private attributes (a leading underscore) and torch's own functions are not followed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

SCALARS = (int, float, complex, str, bytes, bool, type(None))
FOLLOW_DEPTH = 3  # how many levels of the user's own functions loss_values follows

Fingerprint = tuple  # ((label, value), ...), comparable and hashable


def plain_value(value: Any):
    """`value` as a hashable constant a trace may have baked in (numbers, strings, None,
    tuples and lists of them, as a tuple), or None when it is none of these."""
    if isinstance(value, SCALARS):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, SCALARS) for v in value):
        return (tuple(value),)
    return None


def public_values(module: nn.Module) -> dict[str, Any]:
    """The plain values among a module's own public attributes (not `training`: modes are
    tracked on their own)."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training":
            continue
        if plain_value(value) is not None:
            out[name] = value
    return out


def is_config(value: Any) -> bool:
    """Whether `value` is a configuration object a module keeps (a Hugging Face
    `PretrainedConfig`, a dataclass of settings): its fields are watched as a whole."""
    if isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType)) or callable(value):
        return False
    return dataclasses.is_dataclass(value) or (hasattr(value, "to_dict") and
                                                hasattr(value, "__dict__"))


def config_value(value: Any):
    """A configuration object's fingerprint entry: its public plain-valued fields."""
    fields = vars(value) if hasattr(value, "__dict__") else \
        {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # __slots__
    return (type(value).__name__, tuple(sorted(
        (k, plain_value(v)) for k, v in fields.items()
        if not k.startswith("_") and plain_value(v) is not None)))


@contextlib.contextmanager
def attribute_reads() -> Iterator[set[tuple[type, str]]]:
    """While the block runs (a trace), every read of a public plain-valued attribute or
    configuration object (`is_config`) of any module is recorded as (the module's class, the
    attribute's name): tracing runs forward on a fake copy of the model, whose modules are of
    the model's classes."""
    reads: set[tuple[type, str]] = set()
    previous = nn.Module.__dict__.get("__getattribute__")

    def getattribute(self, name):
        value = object.__getattribute__(self, name)
        if name[0] != "_" and name != "training" and (
                isinstance(value, (*SCALARS, tuple, list)) or is_config(value)):
            reads.add((type(self), name))
        return value

    nn.Module.__getattribute__ = getattribute
    try:
        yield reads
    finally:
        if previous is None:
            del nn.Module.__getattribute__
        else:
            nn.Module.__getattribute__ = previous


def watched(root: nn.Module, reads: set[tuple[type, str]]) -> list[tuple[str, str]]:
    """(module path, attribute) of every module of `root` whose class forward read that
    plain-valued attribute or configuration object from (layers traced once and copied share
    their class)."""
    names: dict[type, set[str]] = {}
    for cls, name in reads:
        names.setdefault(cls, set()).add(name)
    out = []
    for path, m in root.named_modules():
        for name in sorted(names.get(type(m), ())):
            if name in vars(m) and (plain_value(vars(m)[name]) is not None or
                                    is_config(vars(m)[name])):
                out.append((path, name))
    return out


def loss_values(loss_fn) -> Fingerprint:
    """The values `loss_fn`'s Python reads that a trace would keep: see the module docstring."""
    out: list[tuple[str, Any]] = []
    _follow(loss_fn, "loss_fn", out, set(), FOLLOW_DEPTH)
    return tuple(out)


def reads_object(fn, wanted, label: str = "loss_fn", depth: int = FOLLOW_DEPTH,
                 seen: set[int] | None = None) -> str | None:
    """The label of an object `fn` reads for which `wanted(obj)` holds (its closure variables,
    defaults, the globals its code names, a partial's arguments, a bound method's object, a
    callable object's attributes), following the user's own functions `depth` levels as
    `loss_values` does; None when it reads none."""
    seen = set() if seen is None else seen
    if depth <= 0 or id(fn) in seen:
        return None
    seen.add(id(fn))
    reads: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        reads += [(f"{label}.args[{i}]", a) for i, a in enumerate(fn.args)]
        reads += [(f"{label}.{k}", a) for k, a in (fn.keywords or {}).items()]
        reads.append((label, fn.func))
    elif isinstance(fn, types.MethodType):
        reads += [(f"{label}.__self__", fn.__self__), (label, fn.__func__)]
    elif isinstance(fn, types.FunctionType) and _is_users(fn):
        code, names = fn.__code__, _code_names(fn.__code__)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                reads.append((f"{label}.<closure {name}>", cell.cell_contents))
        reads += [(f"{label}.<default {i}>", d) for i, d in enumerate(fn.__defaults__ or ())]
        reads += [(f"{label}.{name}", fn.__globals__[name])
                  for name in sorted(names & set(fn.__globals__))]
    elif not isinstance(fn, (types.FunctionType, nn.Module)):
        call = vars(type(fn)).get("__call__")
        if isinstance(call, types.FunctionType) and _is_users(call):  # a callable object
            attrs = getattr(fn, "__dict__", {})
            reads += [(f"{label}.{n}", attrs[n]) for n in sorted(_code_names(call.__code__)
                                                                  & set(attrs))]
            reads.append((label, call))
    for where, value in reads:
        if wanted(value):
            return where
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) or \
                callable(value) and not isinstance(value, (type, nn.Module)):
            found = reads_object(value, wanted, where, depth - 1, seen)
            if found:
                return found
    return None


def forward_classes(model: nn.Module) -> list[type]:
    """The model's module classes whose forward is the user's code (not torch's), once each."""
    out: list[type] = []
    for m in model.modules():
        if type(m) not in out and _is_users(type(m).forward):
            out.append(type(m))
    return out


def forward_values(classes: list[type]) -> Fingerprint:
    """The values the forward of each of `classes` reads besides its module's attributes
    (`attribute_reads`): the globals its code names, its closure variables and defaults,
    following the user's functions it reaches a few levels deep, as `loss_values`."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for cls in classes:
        _follow(cls.forward, f"{cls.__qualname__}.forward", out, seen, FOLLOW_DEPTH)
    return tuple(out)


def changed(old: Fingerprint, new: Fingerprint) -> list[str]:
    """Labels whose values differ between two fingerprints, as 'label: old -> new'."""
    before, after = dict(old), dict(new)
    lines = []
    for label in list(before) + [k for k in after if k not in before]:
        a, b = before.get(label, "(unset)"), after.get(label, "(unset)")
        if a != b:
            lines.append(f"{label}: {_shown(a)} -> {_shown(b)}")
    return lines


def _shown(value) -> str:
    if isinstance(value, tuple) and len(value) == 1:
        return repr(value[0])
    if isinstance(value, tuple) and value and value[0] == "tensor":
        return "another tensor"
    return repr(value)


def _value(value: Any):
    """A fingerprint entry for `value`, or None for what is not followed as a value: a dict of
    plain values (a config read as `CFG["alpha"]`) counts as one, by its items."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, dict) and len(value) <= 256 and all(
            isinstance(k, SCALARS) and plain_value(v) is not None for k, v in value.items()):
        return (tuple((k, plain_value(v)) for k, v in value.items()),)
    return plain_value(value)


def _is_users(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return not (module.startswith(("torch", "numpy", "builtins", "functools")) or
                isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)))


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _follow(obj, label: str, out: list, seen: set[int], depth: int) -> None:
    if depth <= 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        for i, a in enumerate(obj.args):
            _record(f"{label}.args[{i}]", a, out, seen, depth)
        for k, a in (obj.keywords or {}).items():
            _record(f"{label}.{k}", a, out, seen, depth)
        _follow(obj.func, label, out, seen, depth)
        return
    if isinstance(obj, nn.Module):
        for path, m in obj.named_modules():
            for name, v in sorted(public_values(m).items()):
                out.append((".".join(p for p in (label, path, name) if p), plain_value(v)))
        _follow(type(obj).forward, label, out, seen, depth - 1)
        return
    if isinstance(obj, types.MethodType):
        _record(f"{label}.__self__", obj.__self__, out, seen, depth)
        _follow(obj.__func__, label, out, seen, depth)
        return
    if not isinstance(obj, types.FunctionType):
        call = vars(type(obj)).get("__call__")
        if isinstance(call, types.FunctionType) and _is_users(call):  # a callable object
            names = _code_names(call.__code__)
            for name in sorted(names & set(getattr(obj, "__dict__", {}))):
                _record(f"{label}.{name}", obj.__dict__[name], out, seen, depth)
            _follow(call, label, out, seen, depth)
        return
    if not _is_users(obj):
        return
    code = obj.__code__
    for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            _record(f"{label}.<closure {name}>", cell.cell_contents, out, seen, depth,
                    _code_names(code))
    for i, d in enumerate(obj.__defaults__ or ()):
        _record(f"{label}.<default {i}>", d, out, seen, depth)
    for k, d in (obj.__kwdefaults__ or {}).items():
        _record(f"{label}.<default {k}>", d, out, seen, depth)
    names = _code_names(code)
    for name in sorted(names & set(obj.__globals__)):
        _record(f"{getattr(obj, '__module__', '') or ''}.{name}".lstrip("."),
                obj.__globals__[name], out, seen, depth, names)


def _record(label: str, value, out: list, seen: set[int], depth: int,
            names: set[str] | None = None) -> None:
    """One value a function reads: a plain value or tensor as itself; the user's functions and
    loss modules followed; of another object, the plain attributes the code names."""
    v = _value(value)
    if v is not None:
        out.append((label, v))
        return
    if isinstance(value, (types.ModuleType, type)) or inspect.isbuiltin(value):
        return
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial, nn.Module)):
        _follow(value, label, out, seen, depth - 1)
        return
    attrs = getattr(value, "__dict__", None)
    if names and isinstance(attrs, dict) and id(value) not in seen:
        seen.add(id(value))
        for name in sorted(names & set(attrs)):
            if not name.startswith("_"):
                v = _value(attrs[name])
                if v is not None:
                    out.append((f"{label}.{name}", v))
