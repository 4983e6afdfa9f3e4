"""What an exported program must be for autopar to run it, checked with errors a user can act on:
no Python side effects in forward, static shapes, a scalar loss, and export's own failures
explained (what the model did, where, and what to change)."""

from __future__ import annotations

import functools
import inspect
import os
import re
import traceback

import torch
import torch.fx as fx

from .graph_queries import source_line
from .torch_compat import (
    TreeSpec,
    free_unbacked_symbols,
    tree_leaves,
)
from .trace_error import TraceError


def check_no_side_effects(changes: list[str]) -> None:
    if not changes:
        return
    shown = changes[:5] + ([f"... and {len(changes) - 5} more"] if len(changes) > 5 else [])
    raise TraceError(
        "forward changed the model's Python state during tracing:\n  " + "\n  ".join(shown) +
        "\nautopar runs the traced graph, which does not repeat Python side effects: the change "
        "happened once, while tracing, and would never happen again in training or inference. "
        "Move the state change out of forward (e.g. count calls or fill caches in the training "
        "loop), or compute the value with tensor ops and return it from forward.")


_STATIC_SHAPES_HINT = (
    "autopar needs static shapes to split the model across devices. Give the step a fixed "
    "size: for mixture-of-experts routing, give every expert a fixed capacity (pad or drop "
    "tokens to it), or use dense masking (multiply by the mask instead of indexing x[mask]), or "
    "compute every expert on all tokens and weight the outputs by the router's scores.")


def check_static_shapes(gm: fx.GraphModule) -> None:
    """Raise TraceError at the first value whose shape depends on tensor values (torch.nonzero,
    boolean-mask indexing, sizes from .tolist() or .item()): export leaves such sizes unbacked."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        shapes = [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)]
        symbols = free_unbacked_symbols(shapes)
        if not symbols:
            continue
        where = source_line(node) or "unknown line"
        shown = [str(s) for s in shapes if free_unbacked_symbols(s)]
        what = "a tensor of shape" if len(shown) == 1 else "tensors of shapes"
        msg = (f"data-dependent shape: node {node.name} ({node.target}) makes {what} "
               f"{', '.join(shown)}, sizes that depend on tensor values.\n  at {where}\n")
        origin = _unbacked_origin(gm, symbols)
        if origin is not None and origin is not node and source_line(origin) != where:
            msg += (f"  the size comes from node {origin.name} ({origin.target})\n  at "
                    f"{source_line(origin) or 'unknown line'}\n")
        raise TraceError(msg + _STATIC_SHAPES_HINT)


def _unbacked_origin(gm: fx.GraphModule, symbols) -> fx.Node | None:
    """The node that introduced one of `symbols` (export records them in unbacked_bindings)."""
    for node in gm.graph.nodes:
        if set(node.meta.get("unbacked_bindings") or ()) & set(symbols):
            return node
    return None


def check_scalar_loss(gm: fx.GraphModule, loss_spec: TreeSpec, loss_fn) -> None:
    """The loss must be one tensor of one element: each rank must hold the whole loss."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    last = tree_leaves(out.args[0])[-1]
    val = last.meta.get("val") if isinstance(last, fx.Node) else last
    name = _callable_name(loss_fn)
    if not loss_spec.is_leaf():
        n = loss_spec.num_leaves
        raise TraceError(
            f"loss_fn {name} returned a {loss_spec.type.__name__} of {n} value"
            f"{'s' if n != 1 else ''}; it must return one scalar tensor, the loss to minimise. "
            "Compute other values (metrics) from the model's outputs outside loss_fn, and add "
            "auxiliary loss terms into the one loss.")
    if not isinstance(val, torch.Tensor):
        raise TraceError(
            f"loss_fn {name} returned a {type(val).__name__}, not a tensor; it must return the "
            "loss as a scalar tensor (do not call .item() or float() on it inside loss_fn).")
    if val.numel() != 1:
        raise TraceError(
            f"loss_fn {name} returned a tensor of shape {tuple(val.shape)}, not a scalar: every "
            "rank would return only its own piece of it. Reduce the loss to a scalar in loss_fn "
            "with mean or sum (e.g. F.cross_entropy's default reduction='mean', or "
            "loss.mean()).")


def _callable_name(fn) -> str:
    """`fn`'s name and where it is defined, for messages: "lm_loss (gpt.py:120)"."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    name = getattr(target, "__qualname__", type(fn).__name__)
    try:
        where = f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return name
    return f"{name} ({where})"


def explain_export_failure(e: Exception) -> str:
    """Point at the user's line: the innermost traceback frame outside torch and site-packages."""
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    user = [f for f in frames if not f.filename.startswith(torch_dir)
            and "site-packages" not in f.filename and "<" not in f.filename
            and not f.filename.endswith(os.path.join("passes", "trace.py"))]
    where = f"{user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else "unknown line"
    kind = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else kind
    hint = "autopar could not capture the model with torch.export (non-strict)."
    unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", text)
    if unknown:
        hint = _unknown_output_hint(unknown.group(1))
    elif _is_data_dependent_size(kind, str(e)):
        hint = ("data-dependent shape: the model uses tensor values as sizes (e.g. .tolist() or "
                ".item() split sizes, loop counts or slice bounds, torch.nonzero, boolean-mask "
                "indexing). " + _STATIC_SHAPES_HINT)
    elif any(s in f"{kind} {e}" for s in (
            "data-dependent", "DataDependent", "GuardOnDataDependent", "Could not guard",
            "symbolic", "item()")):
        hint = ("The model branches on tensor values (data-dependent control flow), which a "
                "static graph cannot express. Replace the Python `if`/loop on a tensor value with "
                "tensor ops (torch.where, masking) or move it out of forward.")
    return f"{hint}\n  at {where}\n  torch.export said: {kind}: {text}"


def _unknown_output_hint(cls: str) -> str:
    """What to do when the model returns an object of class `cls` that holds tensors but is no
    pytree (torch.export cannot take it apart into the graph's outputs)."""
    if cls.startswith("transformers.") and cls.endswith("Cache"):
        return (f"the model returns a key/value cache ({cls}), as a Hugging Face model does "
                "when its config has use_cache=True (the default): set "
                "`model.config.use_cache = False` before parallelize (training needs no "
                "cache, and autopar's programs cannot return one).")
    return (f"the model returns a {cls} object, which torch.export cannot take apart into "
            "tensors: return tensors (or tuples, lists and dicts of them), or "
            "register the class with torch.utils._pytree.register_pytree_node.")


def _is_data_dependent_size(kind: str, text: str) -> bool:
    """Export's words for a tensor value used as a Python int (a size, a count, split sizes)
    rather than as a condition; a symbol export marks size-like is a size."""
    if "extract specialized integer" in text or "DynamicOutputShape" in kind:
        return True
    marker = "Size-like symbols:"
    return marker in text and f"{marker} none" not in text


def same_constants(a: dict, b: dict) -> bool:
    """Whether two exports lifted the same constants (names and values)."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x is y:  # (the same tensor lifted twice: a fake one has no values to compare)
            continue
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            try:
                if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                    return False
            except Exception:  # noqa: BLE001 - values it cannot compare count as different
                return False
        elif x is not y:
            return False
    return True
