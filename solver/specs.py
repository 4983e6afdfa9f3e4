"""What a plan prices besides ops: the optimizer's state per parameter and the training
precision (a leaf: every solver module may import it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer keeps per parameter: `states` tensors of the parameter's shape (in the
    master dtype: float32 under mixed precision, the parameter's dtype otherwise) and
    `scalar_bytes` per parameter tensor (AdamW's `step`, a float32 scalar tensor)."""

    name: str = "adamw"
    states: int = 2
    scalar_bytes: int = 4


OPTIMIZERS = {
    "adamw": OptimizerSpec("adamw", 2, 4),
    "adam": OptimizerSpec("adam", 2, 4),
    "sgd-momentum": OptimizerSpec("sgd-momentum", 1, 0),
    "sgd": OptimizerSpec("sgd", 0, 0),
}


@dataclass(frozen=True)
class Precision:
    """Dtypes of training: `compute` for floating-point parameters, activations, gradients and
    collectives; `master` for the optimizer's copy of the weights and its state (None: the
    parameters themselves, no copy)."""

    name: str = "fp32"
    compute: torch.dtype = torch.float32
    master: torch.dtype | None = None


PRECISIONS = {
    "fp32": Precision("fp32", torch.float32, None),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16, torch.float32),
}


def compute_dtype(precision: str | Precision | None) -> torch.dtype | None:
    """The dtype a mixed-precision plan computes in (None: the parameters' own)."""
    spec = precision_spec(precision)
    return spec.compute if spec.master is not None else None


def optimizer_spec(optimizer: str | OptimizerSpec | None) -> OptimizerSpec:
    """An optimizer by name ("adamw", "adam", "sgd-momentum", "sgd"), or the given spec."""
    return _named(optimizer, OptimizerSpec, OPTIMIZERS, "adamw", "optimizer",
                  " or pass an OptimizerSpec")


def precision_spec(precision: str | Precision | None) -> Precision:
    """A precision by name ("fp32", "bf16-mixed"), or the given spec."""
    return _named(precision, Precision, PRECISIONS, "fp32", "precision")


def _named(value, spec_type: type, table: dict, default: str, what: str, hint: str = ""):
    if value is None:
        return table[default]
    if isinstance(value, spec_type):
        return value
    try:
        return table[value.lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {value!r}; choose from "
                         f"{', '.join(table)}{hint}") from None


def numel(shape) -> int:
    """Elements of a tensor of `shape` (1 for a scalar)."""
    return math.prod(shape) if shape else 1
