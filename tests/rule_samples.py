"""Sample calls for every op in `autopar.passes.rules.RULES`, used by tests/test_rules.py.

A sample is an op plus a builder `build(g) -> (args, kwargs)` that returns the op's arguments
with concrete tensors (float64 where the op allows it, so that the sharded and unsharded results
can be compared tightly). Arguments are written the way the tracer records them (positional for
positional parameters, keywords for keyword-only ones, trailing defaults usually left out).

Sizes are chosen so that on a mesh dimension of 2 or 3 some strategies divide evenly and others
do not (dimensions of 4 and 8 split only by 2, 6 and 12 by both, 5 by neither): the test skips a
strategy whose sharded dimensions do not split evenly, as the planner does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten
F64 = torch.float64
F32 = torch.float32
BIG = 9223372036854775807  # how a traced `x[a:]` spells "to the end"


class Gen:
    """Seeded tensor factory handed to sample builders."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def f(self, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
        """Standard normal values."""
        return torch.randn(shape, generator=self.g, dtype=dtype)

    def pos(self, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
        """Positive values in [0.5, 1.5) (for log, sqrt, divisors, ...)."""
        return torch.rand(shape, generator=self.g, dtype=dtype) + 0.5

    def i(self, low: int, high: int, *shape: int) -> torch.Tensor:
        """int64 values in [low, high)."""
        return torch.randint(low, high, shape, generator=self.g)

    def b(self, *shape: int) -> torch.Tensor:
        """Random booleans."""
        return torch.rand(shape, generator=self.g) > 0.5

    def scalar(self, dtype: torch.dtype = F64) -> torch.Tensor:
        """A 0-d tensor."""
        return torch.randn((), generator=self.g, dtype=dtype)


@dataclass(frozen=True)
class Sample:
    op: Any
    name: str
    build: Callable[[Gen], tuple[tuple, dict]]
    no_grad: tuple[int, ...] = ()  # tensor inputs (flattened order) torch cannot differentiate
    exact: bool = False  # compare bit for bit (random ops: each rank's draw is the whole one's)

    @property
    def op_name(self) -> str:
        return str(self.op).removeprefix("aten.")

    @property
    def id(self) -> str:
        return f"{self.op_name}[{self.name}]"


def _keep_a_key(mask: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask where every query row attends to at least one key."""
    mask = mask.clone()
    mask[..., 0] = True
    return mask


def _with_value(idx: torch.Tensor, value: int) -> torch.Tensor:
    """Indices where a few entries (also in the first and last rows) equal `value`."""
    idx = idx.clone()
    idx.view(-1)[:: 5] = value
    return idx


SAMPLES: list[Sample] = []


def add(op, name: str, build: Callable[[Gen], tuple[tuple, dict]],
        no_grad: tuple[int, ...] = (), exact: bool = False) -> None:
    if any(s.op == op and s.name == name for s in SAMPLES):
        raise ValueError(f"duplicate sample {op} {name}")
    SAMPLES.append(Sample(op, name, build, no_grad, exact))


def call(*args, **kwargs) -> tuple[tuple, dict]:
    return args, kwargs


# ---------------------------------------------------------------------------------------------
# Pointwise
# ---------------------------------------------------------------------------------------------

_UNARY_FLOAT = {
    aten.abs.default: (), aten.exp.default: (), aten.sin.default: (), aten.cos.default: (),
    aten.tanh.default: (), aten.sigmoid.default: (), aten.relu.default: (),
    aten.silu.default: (), aten.erf.default: (), aten.expm1.default: (), aten.sign.default: (),
    aten.floor.default: (), aten.ceil.default: (), aten.round.default: (),
    aten.square.default: (), aten.mish.default: (), aten.relu6.default: (),
    aten.neg.default: (), aten.clone.default: (), aten.alias.default: (),
    aten.detach.default: (), aten.elu.default: (), aten.gelu.default: (),
    aten.leaky_relu.default: (0.1,), aten.hardtanh.default: (-0.5, 0.7),
    aten.softplus.default: (2.0, 5.0), aten.clamp.default: (-0.5, 0.6),
    aten.clamp_min.default: (0.1,), aten.clamp_max.default: (-0.2,),
    aten.gt.Scalar: (0.1,), aten.lt.Scalar: (0.1,), aten.ge.Scalar: (-0.2,),
    aten.le.Scalar: (0.3,), aten.ne.Scalar: (0.0,), aten.add.Scalar: (1.5,),
    aten.sub.Scalar: (0.5,), aten.rsub.Scalar: (2.0,), aten.remainder.Scalar: (0.7,),
    aten.fmod.Scalar: (0.7,), aten.mul.Scalar: (2.5,), aten.div.Scalar: (4.0,),
    aten.pow.Tensor_Scalar: (2,),
}
_UNARY_POSITIVE = {
    aten.log.default: (), aten.sqrt.default: (), aten.rsqrt.default: (),
    aten.reciprocal.default: (), aten.log1p.default: (),
}

for _op, _extra in _UNARY_FLOAT.items():
    add(_op, "6x4x5", lambda g, _e=_extra: call(g.f(6, 4, 5), *_e))
    add(_op, "12x5", lambda g, _e=_extra: call(g.f(12, 5), *_e))
for _op, _extra in _UNARY_POSITIVE.items():
    add(_op, "6x4x5", lambda g, _e=_extra: call(g.pos(6, 4, 5), *_e))

add(aten.gelu.default, "tanh", lambda g: call(g.f(6, 4), approximate="tanh"))
add(aten.elu.default, "alpha", lambda g: call(g.f(6, 4), 0.5, 2.0))
add(aten.pow.Tensor_Scalar, "frac", lambda g: call(g.pos(6, 4, 5), 1.5))
add(aten.add.Scalar, "alpha", lambda g: call(g.f(6, 4), 2, 3))
add(aten.eq.Scalar, "int", lambda g: call(g.i(0, 3, 6, 4, 5), 1))
add(aten.ne.Scalar, "int", lambda g: call(g.i(0, 3, 6, 4), 2))
add(aten.logical_not.default, "bool", lambda g: call(g.b(6, 4, 5)))
add(aten.bitwise_not.default, "int", lambda g: call(g.i(-9, 9, 6, 4, 5)))
add(aten.bitwise_not.default, "bool", lambda g: call(g.b(12, 5)))
add(aten.mul.Scalar, "int", lambda g: call(g.i(-9, 9, 6, 4), 3))
add(aten.clone.default, "1d", lambda g: call(g.f(6)))

# Conversions: to a float type (linear, a pending sum may pass) and to an integer type (not).
add(aten.to.dtype, "f32", lambda g: call(g.f(6, 4, 5), F32))
add(aten.to.dtype, "to_int", lambda g: call(g.f(6, 4) * 10, torch.int64))
add(aten.to.dtype, "from_int", lambda g: call(g.i(-9, 9, 6, 4), F64))
add(aten.to.dtype_layout, "f32", lambda g: call(
    g.f(6, 4, 5), dtype=F32, layout=torch.strided, device=torch.device("cpu")))
add(aten.to.dtype_layout, "to_int", lambda g: call(
    g.f(6, 4) * 10, dtype=torch.int32, layout=torch.strided, device=torch.device("cpu")))
add(aten.to.device, "f64", lambda g: call(g.f(6, 4, 5), torch.device("cpu"), F64))
add(aten.to.device, "to_int", lambda g: call(g.f(6, 4) * 10, torch.device("cpu"), torch.int64))
add(aten._to_copy.default, "f32", lambda g: call(g.f(6, 4, 5), dtype=F32))
add(aten._to_copy.default, "same", lambda g: call(g.f(6, 4, 5)))
add(aten._to_copy.default, "to_int", lambda g: call(g.f(6, 4) * 10, dtype=torch.int64))
add(aten.type_as.default, "to_f32", lambda g: call(g.f(6, 4, 5), g.f(6, 4, 5, dtype=F32)))
add(aten.type_as.default, "broadcast", lambda g: call(g.f(6, 4, 5), g.f(4, 1, dtype=F32)))
add(aten.type_as.default, "to_int", lambda g: call(g.f(6, 4) * 10, g.i(-9, 9, 6, 4)))
add(aten.contiguous.default, "transposed", lambda g: call(g.f(4, 6).t()))
add(aten.contiguous.default, "3d", lambda g: call(g.f(6, 4, 5)))

# Binary with broadcasting.
_BINARY_FLOAT = [
    aten.maximum.default, aten.minimum.default, aten.lt.Tensor, aten.le.Tensor,
    aten.gt.Tensor, aten.ge.Tensor, aten.atan2.default, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Tensor,
]
for _op in _BINARY_FLOAT:
    add(_op, "same", lambda g: call(g.f(6, 4, 5), g.f(6, 4, 5)))
    add(_op, "bcast_row", lambda g: call(g.f(6, 4), g.f(4)))
    add(_op, "bcast_both", lambda g: call(g.f(6, 1, 5), g.f(4, 1)))
for _op in (aten.eq.Tensor, aten.ne.Tensor):
    add(_op, "int", lambda g: call(g.i(0, 3, 6, 4), g.i(0, 3, 4)))
    add(_op, "float", lambda g: call(g.f(6, 4).round(), g.f(6, 1).round()))
for _op in (aten.__and__.Tensor, aten.__or__.Tensor, aten.logical_and.default,
            aten.logical_or.default):
    add(_op, "bool", lambda g: call(g.b(6, 4, 5), g.b(4, 5)))
for _op in (aten.bitwise_and.Tensor, aten.bitwise_or.Tensor):
    add(_op, "int", lambda g: call(g.i(0, 16, 6, 4), g.i(0, 16, 6, 4)))
    add(_op, "bool_bcast", lambda g: call(g.b(6, 1), g.b(4)))
add(aten.__and__.Tensor, "int", lambda g: call(g.i(0, 16, 6, 4), g.i(0, 16, 4)))
add(aten.pow.Tensor_Tensor, "bcast", lambda g: call(g.pos(6, 4, 5), g.f(5)))
add(aten.pow.Tensor_Tensor, "same", lambda g: call(g.pos(12, 5), g.f(12, 5)))
add(aten.div.Tensor_mode, "floor", lambda g: call(g.f(6, 4) * 5, g.pos(4), rounding_mode="floor"))
add(aten.div.Tensor_mode, "trunc", lambda g: call(g.f(6, 4, 5) * 5, g.pos(6, 4, 5),
                                                  rounding_mode="trunc"))
for _op in (aten.remainder.Tensor, aten.fmod.Tensor):
    add(_op, "bcast", lambda g: call(g.f(6, 4) * 3, g.pos(4)))
    add(_op, "same", lambda g: call(g.f(6, 4, 5) * 3, g.pos(6, 4, 5)))
add(aten.where.self, "bcast", lambda g: call(g.b(6, 4, 5), g.f(6, 4, 5), g.f(5)))
add(aten.where.self, "cond_bcast", lambda g: call(g.b(4, 1), g.f(6, 4, 5), g.f(6, 1, 5)))
add(aten.where.self, "scalar_other", lambda g: call(g.b(6, 4), g.f(6, 4), g.scalar()))
add(aten.where.ScalarOther, "number", lambda g: call(g.b(6, 4), g.f(6, 4), -1e4))
add(aten.where.ScalarSelf, "bcast", lambda g: call(g.b(6, 1), 0.5, g.f(6, 4)))
add(aten.masked_fill.Scalar, "bcast_mask", lambda g: call(g.f(6, 4, 5), g.b(4, 5), -1.5))
add(aten.masked_fill.Scalar, "same", lambda g: call(g.f(12, 5), g.b(12, 5), 0.0))
add(aten.masked_fill.Tensor, "scalar_value", lambda g: call(g.f(6, 4, 5), g.b(6, 1, 5),
                                                            g.scalar()))
add(aten.addcmul.default, "bcast", lambda g: call(g.f(6, 4, 5), g.f(4, 5), g.f(6, 1, 5),
                                                  value=0.5))
add(aten.addcmul.default, "same", lambda g: call(g.f(12, 5), g.f(12, 5), g.f(12, 5)))
add(aten.addcdiv.default, "bcast", lambda g: call(g.f(6, 4, 5), g.f(4, 5), g.pos(6, 1, 5),
                                                  value=-2.0))
add(aten.lerp.Scalar, "bcast", lambda g: call(g.f(6, 4, 5), g.f(5), 0.3))
add(aten.lerp.Scalar, "same", lambda g: call(g.f(12, 5), g.f(12, 5), 0.75))

# Arithmetic with pending sums: two tensors, a tensor and a number, a 0-d tensor.
add(aten.add.Tensor, "alpha", lambda g: call(g.f(6, 4), g.f(6, 4), alpha=2.5))
add(aten.add.Tensor, "number", lambda g: call(g.f(6, 4, 5), 2.0))
add(aten.sub.Tensor, "number", lambda g: call(g.f(6, 4, 5), 2.0))
add(aten.sub.Tensor, "alpha", lambda g: call(g.f(6, 4), g.f(4), alpha=0.5))
add(aten.mul.Tensor, "number", lambda g: call(g.f(6, 4, 5), 3.0))
add(aten.mul.Tensor, "scalar_tensor", lambda g: call(g.f(6, 4), g.scalar()))
add(aten.mul.Tensor, "bool_mask", lambda g: call(g.f(6, 4), g.b(6, 4)))
add(aten.div.Tensor, "same", lambda g: call(g.f(6, 4, 5), g.pos(6, 4, 5)))
add(aten.div.Tensor, "bcast", lambda g: call(g.f(6, 4), g.pos(4)))
add(aten.div.Tensor, "number", lambda g: call(g.f(6, 4, 5), 3.0))
add(aten.div.Tensor, "int_true_div", lambda g: call(g.i(-9, 9, 6, 4), g.i(1, 5, 4)))
add(aten.broadcast_tensors.default, "two", lambda g: call([g.f(6, 1, 5), g.f(4, 1)]))
add(aten.broadcast_tensors.default, "three", lambda g: call([g.f(6, 4), g.f(4), g.f(6, 1)]))

# ---------------------------------------------------------------------------------------------
# Reductions and softmax
# ---------------------------------------------------------------------------------------------

add(aten.sum.dim_IntList, "dim1", lambda g: call(g.f(6, 4, 5), [1]))
add(aten.sum.dim_IntList, "dim1_keep", lambda g: call(g.f(6, 4, 5), [1], True))
add(aten.sum.dim_IntList, "dims02", lambda g: call(g.f(6, 4, 5), [0, 2]))
add(aten.sum.dim_IntList, "neg_keep", lambda g: call(g.f(6, 4, 12), [-1], True))
add(aten.sum.dim_IntList, "none", lambda g: call(g.f(6, 4), None))
add(aten.sum.dim_IntList, "bool", lambda g: call(g.b(6, 4), [0]))
add(aten.sum.dim_IntList, "dtype", lambda g: call(g.f(6, 4, dtype=F32), [0], dtype=F64))
add(aten.sum.default, "all", lambda g: call(g.f(6, 4, 5)))
add(aten.sum.default, "dtype", lambda g: call(g.i(-5, 5, 6, 4), dtype=F64))
add(aten.mean.dim, "dim1", lambda g: call(g.f(6, 4, 5), [1]))
add(aten.mean.dim, "dim0_keep", lambda g: call(g.f(6, 4, 5), [0], True))
add(aten.mean.dim, "dims01", lambda g: call(g.f(6, 4, 5), [0, 1]))
add(aten.mean.dim, "neg_keep", lambda g: call(g.f(6, 12), [-1], True))
add(aten.mean.dim, "dtype", lambda g: call(g.f(6, 4, dtype=F32), [0], dtype=F64))
add(aten.mean.default, "all", lambda g: call(g.f(6, 4, 5)))
add(aten.mean.default, "2d", lambda g: call(g.f(12, 6)))
add(aten.amax.default, "dim1_keep", lambda g: call(g.f(6, 4, 5), [1], True))
add(aten.amax.default, "all", lambda g: call(g.f(6, 4)))
add(aten.amin.default, "dim0", lambda g: call(g.f(6, 4, 5), [0]))
add(aten.amin.default, "dims", lambda g: call(g.f(6, 4, 12), [0, 2], True))
add(aten.any.dim, "dim1", lambda g: call(g.b(6, 4, 5), 1))
add(aten.any.dim, "dim0_keep", lambda g: call(g.b(6, 4), 0, True))
add(aten.all.dim, "dim2", lambda g: call(g.b(6, 4, 5) | g.b(6, 4, 5), 2))
add(aten.all.dim, "dim0_keep", lambda g: call(g.b(6, 4), 0, True))
add(aten.argmax.default, "dim1_keep", lambda g: call(g.f(6, 4, 5), 1, True))
add(aten.argmax.default, "flat", lambda g: call(g.f(6, 4)))
add(aten.argmin.default, "dim0", lambda g: call(g.f(6, 4, 5), 0))
add(aten.argmin.default, "neg", lambda g: call(g.f(6, 12), -1))
add(aten.prod.dim_int, "dim1", lambda g: call(g.f(6, 4, 5), 1))
add(aten.prod.dim_int, "dim0_keep", lambda g: call(g.f(6, 4), 0, True))
add(aten.var.correction, "dim1_keep", lambda g: call(g.f(6, 4, 5), [1], correction=1,
                                                      keepdim=True))
add(aten.var.correction, "all", lambda g: call(g.f(6, 4)))
add(aten.var.correction, "dim0", lambda g: call(g.f(6, 4, 5), [0], correction=0))
add(aten.std.correction, "dim2", lambda g: call(g.f(6, 4, 5), [2]))
add(aten.std.correction, "dims", lambda g: call(g.f(6, 4, 12), [0, 2], correction=1,
                                                 keepdim=True))
add(aten.expand_as.default, "broadcast_last", lambda g: call(g.f(6, 1), g.f(6, 4)))
add(aten.expand_as.default, "leading", lambda g: call(g.f(4, 5), g.f(6, 4, 5)))
add(aten.linalg_vector_norm.default, "last_keep", lambda g: call(g.f(6, 4, 5), 2, [-1], True))
add(aten.linalg_vector_norm.default, "dim0", lambda g: call(g.f(6, 4), 2, [0]))
add(aten.linalg_vector_norm.default, "all", lambda g: call(g.f(6, 4)))
add(aten.logsumexp.default, "dim1", lambda g: call(g.f(6, 4, 5), [1]))
add(aten.logsumexp.default, "dim0_keep", lambda g: call(g.f(6, 4, 5), [0], True))

add(aten._softmax.default, "dim1", lambda g: call(g.f(6, 4, 5), 1, False))
add(aten._softmax.default, "last", lambda g: call(g.f(6, 12), -1, False))
add(aten._log_softmax.default, "dim0", lambda g: call(g.f(6, 4, 5), 0, False))
add(aten._log_softmax.default, "last", lambda g: call(g.f(6, 4, 5), -1, False))
add(aten.softmax.int, "last", lambda g: call(g.f(6, 4, 5), -1))
add(aten.softmax.int, "dtype", lambda g: call(g.f(6, 4, dtype=F32), 0, F64))
add(aten.log_softmax.int, "dim1", lambda g: call(g.f(6, 4, 5), 1))
add(aten.log_softmax.int, "last", lambda g: call(g.f(12, 6), -1))
add(aten.cumsum.default, "dim1", lambda g: call(g.f(6, 4, 5), 1))
add(aten.cumsum.default, "dim0", lambda g: call(g.f(6, 12), 0))
add(aten.topk.default, "dim1", lambda g: call(g.f(6, 4, 5), 2, 1))
add(aten.topk.default, "last_smallest", lambda g: call(g.f(6, 12), 3, -1, False))
add(aten.topk.default, "unsorted", lambda g: call(g.f(12, 5), 2, 1, True, False))
add(aten.topk.default, "dim0", lambda g: call(g.f(6, 4), 4, 0))

# ---------------------------------------------------------------------------------------------
# Views, reshapes and data movement
# ---------------------------------------------------------------------------------------------

_RESHAPES = {
    "merge_4x6x8_24x8": ((4, 6, 8), [24, 8]),
    "split_24x8_4x6x8": ((24, 8), [4, 6, 8]),
    "merge_inner_4x6x8_4x48": ((4, 6, 8), [4, 48]),
    "split_inner_2x16_2x4x4": ((2, 16), [2, 4, 4]),
    "regroup_4x6_2x12": ((4, 6), [2, 12]),
    "regroup_6x4_4x6": ((6, 4), [4, 6]),
    "split_12x5_3x4x5": ((12, 5), [3, 4, 5]),
    "split_12x5_6x2x5": ((12, 5), [6, 2, 5]),
    "infer_6x4x2_m1x2": ((6, 4, 2), [-1, 2]),
    "unit_6x1x4_6x4": ((6, 1, 4), [6, 4]),
    "unit_6x4_1x6x1x4": ((6, 4), [1, 6, 1, 4]),
    "flat_6x4x5": ((6, 4, 5), [120]),
    "unflat_120": ((120,), [6, 4, 5]),
    "same_6x12": ((6, 12), [6, 12]),
}
for _name, (_shape, _target) in _RESHAPES.items():
    add(aten.view.default, _name, lambda g, _s=_shape, _t=_target: call(g.f(*_s), _t))
# Every pair among these shapes of 24 elements (merges, splits, regroupings, unit dims).
_SHAPES_24 = [(24,), (4, 6), (6, 4), (2, 12), (2, 3, 4), (4, 3, 2), (3, 8), (2, 2, 6), (4, 1, 6)]
for _a in _SHAPES_24:
    for _b in _SHAPES_24:
        if _a != _b:
            add(aten.view.default, "x".join(map(str, _a)) + "_to_" + "x".join(map(str, _b)),
                lambda g, _s=_a, _t=_b: call(g.f(*_s), list(_t)))
for _name in ("merge_4x6x8_24x8", "split_24x8_4x6x8", "merge_inner_4x6x8_4x48",
              "split_12x5_3x4x5", "regroup_4x6_2x12", "infer_6x4x2_m1x2"):
    _shape, _target = _RESHAPES[_name]
    add(aten.reshape.default, _name, lambda g, _s=_shape, _t=_target: call(g.f(*_s), _t))
    add(aten._unsafe_view.default, _name, lambda g, _s=_shape, _t=_target: call(g.f(*_s), _t))
add(aten.reshape.default, "noncontig_6x4x2", lambda g: call(g.f(4, 6, 2).transpose(0, 1),
                                                          [6, 8]))
add(aten.flatten.using_ints, "inner", lambda g: call(g.f(4, 6, 8), 1, 2))
add(aten.flatten.using_ints, "outer", lambda g: call(g.f(4, 6, 5), 0, 1))
add(aten.flatten.using_ints, "all", lambda g: call(g.f(6, 4, 5)))
add(aten.flatten.using_ints, "neg", lambda g: call(g.f(6, 4, 2, 3), -3, -2))
add(aten.unflatten.int, "inner", lambda g: call(g.f(4, 24), 1, [6, 4]))
add(aten.unflatten.int, "outer", lambda g: call(g.f(12, 5), 0, [3, 4]))
add(aten.unflatten.int, "outer6", lambda g: call(g.f(12, 5), 0, [6, 2]))
add(aten.unflatten.int, "infer", lambda g: call(g.f(4, 24), -1, [-1, 4]))

add(aten.transpose.int, "0_2", lambda g: call(g.f(4, 6, 5), 0, 2))
add(aten.transpose.int, "neg", lambda g: call(g.f(4, 6, 12), -1, 1))
add(aten.permute.default, "201", lambda g: call(g.f(4, 6, 5), [2, 0, 1]))
add(aten.permute.default, "neg", lambda g: call(g.f(4, 6, 5, 3), [0, -1, 1, 2]))
add(aten.t.default, "2d", lambda g: call(g.f(4, 6)))
add(aten.t.default, "1d", lambda g: call(g.f(6)))
add(aten.unsqueeze.default, "mid", lambda g: call(g.f(4, 6), 1))
add(aten.unsqueeze.default, "last", lambda g: call(g.f(4, 6), -1))
add(aten.unsqueeze.default, "first", lambda g: call(g.f(6, 5), 0))
add(aten.squeeze.dim, "unit", lambda g: call(g.f(4, 1, 6), 1))
add(aten.squeeze.dim, "not_unit", lambda g: call(g.f(4, 6), 1))
add(aten.squeeze.dims, "two", lambda g: call(g.f(4, 1, 6, 1), [1, -1]))
add(aten.squeeze.default, "all", lambda g: call(g.f(1, 4, 1, 6)))
add(aten.expand.default, "middle", lambda g: call(g.f(4, 1, 6), [4, 5, 6]))
add(aten.expand.default, "lead", lambda g: call(g.f(6), [4, 6]))
add(aten.expand.default, "lead_and_unit", lambda g: call(g.f(4, 1), [2, 4, 6]))
add(aten.expand.default, "minus_one", lambda g: call(g.f(4, 1, 6), [-1, 3, -1]))
add(aten.slice.Tensor, "dim1", lambda g: call(g.f(4, 6, 5), 1, 1, 5))
add(aten.slice.Tensor, "full", lambda g: call(g.f(4, 6, 5), 0, 0, BIG))
add(aten.slice.Tensor, "step", lambda g: call(g.f(4, 6, 5), 2, 0, 5, 2))
add(aten.slice.Tensor, "neg_dim", lambda g: call(g.f(6, 12), -1, 2, 8))
add(aten.slice.Tensor, "dim0_tail", lambda g: call(g.f(6, 4), 0, 2))
add(aten.select.int, "dim1", lambda g: call(g.f(4, 6, 5), 1, 2))
add(aten.select.int, "last_index", lambda g: call(g.f(4, 6, 5), 0, -1))
add(aten.select.int, "neg_dim", lambda g: call(g.f(6, 4, 12), -1, 3))
add(aten.slice_scatter.default, "dim1", lambda g: call(g.f(4, 6, 5), g.f(4, 2, 5), 1, 1, 3))
add(aten.slice_scatter.default, "rows", lambda g: call(g.f(6, 4), g.f(2, 4), 0, 0, 2))
add(aten.slice_scatter.default, "step", lambda g: call(g.f(4, 6, 6), g.f(4, 6, 3), 2, 0, 6, 2))
add(aten.select_scatter.default, "dim1", lambda g: call(g.f(4, 6, 5), g.f(4, 5), 1, 2))
add(aten.select_scatter.default, "last", lambda g: call(g.f(4, 6, 6), g.f(4, 6), -1, -1))
add(aten.zeros_like.default, "plain", lambda g: call(g.f(4, 6)))
add(aten.ones_like.default, "plain", lambda g: call(g.f(4, 6, 2)))
add(aten.full_like.default, "value", lambda g: call(g.f(4, 6), 2.5))
add(aten.narrow.default, "dim1", lambda g: call(g.f(4, 6, 5), 1, 2, 3))
add(aten.narrow.default, "rows", lambda g: call(g.f(6, 4), 0, 0, 2))
add(aten.index_put.default, "columns_scalar",
    lambda g: call(g.f(4, 6, 5), [None, g.i(0, 6, 2)], g.scalar()))
add(aten.index_put.default, "rows_values",
    lambda g: call(g.f(6, 4), [g.i(0, 6, 3)], g.f(3, 4)))
add(aten.index_put.default, "middle_values",
    lambda g: call(g.f(4, 6, 5), [None, g.i(0, 6, 2)], g.f(4, 2, 5)))
add(aten.index_put.default, "mask",
    lambda g: call(g.f(4, 6, 5), [g.b(4, 6)], g.scalar()))
add(aten.index_put.default, "accumulate",
    lambda g: call(g.f(4, 6), [None, g.i(0, 6, 3)], g.f(3), True))
add(aten.fill.Scalar, "value", lambda g: call(g.f(4, 6), -1.5))
add(aten.fill.Tensor, "zero_dim", lambda g: call(g.f(4, 6), g.scalar()))
add(aten.split.Tensor, "dim1", lambda g: call(g.f(4, 6, 5), 2, 1))
add(aten.split.Tensor, "uneven_dim0", lambda g: call(g.f(4, 6, 12), 3))
add(aten.split.Tensor, "last", lambda g: call(g.f(6, 4, 12), 5, -1))
add(aten.split_with_sizes.default, "dim1", lambda g: call(g.f(4, 6, 5), [2, 4], 1))
add(aten.split_with_sizes.default, "dim0", lambda g: call(g.f(12, 6), [5, 7]))
add(aten.unbind.int, "dim2", lambda g: call(g.f(4, 6, 3), 2))
add(aten.unbind.int, "dim0", lambda g: call(g.f(2, 6, 4)))
add(aten.chunk.default, "dim1", lambda g: call(g.f(4, 6, 5), 2, 1))
add(aten.chunk.default, "dim0", lambda g: call(g.f(6, 12), 3))
add(aten.roll.default, "two_dims", lambda g: call(g.f(4, 6, 6, 3), [-2, 3], [1, 2]))
add(aten.roll.default, "neg_dim", lambda g: call(g.f(4, 6), [1], [-1]))
add(aten.roll.default, "flattened", lambda g: call(g.f(4, 6), [5]))
add(aten.constant_pad_nd.default, "last", lambda g: call(g.f(6, 4), [0, 1], -1.0))
add(aten.constant_pad_nd.default, "two_dims", lambda g: call(g.f(6, 4, 5), [1, 0, 2, 1]))
add(aten.pad.default, "constant_last", lambda g: call(g.f(6, 4), [0, 1], "constant", -100.0))
add(aten.cat.default, "dim1", lambda g: call([g.f(4, 6), g.f(4, 2)], 1))
add(aten.cat.default, "dim0", lambda g: call([g.f(2, 6, 4), g.f(4, 6, 4)]))
add(aten.cat.default, "three_last", lambda g: call([g.f(6, 4, 5), g.f(6, 4, 1), g.f(6, 4, 2)],
                                                   -1))
add(aten.stack.default, "dim0", lambda g: call([g.f(4, 6), g.f(4, 6)]))
add(aten.stack.default, "dim1", lambda g: call([g.f(4, 6), g.f(4, 6), g.f(4, 6)], 1))
add(aten.stack.default, "last", lambda g: call([g.f(6, 4), g.f(6, 4)], -1))
add(aten.repeat_interleave.self_int, "dim0", lambda g: call(g.f(6, 4), 2, 0))
add(aten.repeat_interleave.self_int, "dim1", lambda g: call(g.f(4, 6, 5), 3, 1))
add(aten.repeat_interleave.self_int, "flat", lambda g: call(g.f(6, 4), 2))
add(aten.repeat_interleave.self_int, "output_size", lambda g: call(g.f(6, 4), 2, 0,
                                                                  output_size=12))

# ---------------------------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------------------------

add(aten.linear.default, "bias", lambda g: call(g.f(6, 8), g.f(4, 8), g.f(4)))
add(aten.linear.default, "nobias", lambda g: call(g.f(6, 8), g.f(12, 8)))
add(aten.linear.default, "3d_bias", lambda g: call(g.f(4, 6, 8), g.f(6, 8), g.f(6)))
add(aten.linear.default, "3d_nobias", lambda g: call(g.f(2, 6, 12), g.f(4, 12)))
add(aten.linear.default, "bias_none", lambda g: call(g.f(6, 8), g.f(4, 8), None))
add(aten.linear.default, "odd", lambda g: call(g.f(5, 6), g.f(3, 6), g.f(3)))
add(aten.linear.default, "vector_x", lambda g: call(g.f(6), g.f(4, 6), g.f(4)))
add(aten.addmm.default, "bias_row", lambda g: call(g.f(4), g.f(6, 8), g.f(8, 4)))
add(aten.addmm.default, "bias_full", lambda g: call(g.f(6, 4), g.f(6, 8), g.f(8, 4)))
add(aten.addmm.default, "beta_alpha", lambda g: call(g.f(12), g.f(6, 8), g.f(8, 12),
                                                     beta=0.5, alpha=2.0))
add(aten.addmm.default, "bias_full_alpha", lambda g: call(g.f(6, 4), g.f(6, 6), g.f(6, 4),
                                                          beta=-1.5, alpha=0.25))
add(aten.addmm.default, "odd", lambda g: call(g.f(5), g.f(6, 5), g.f(5, 5)))
add(aten.mm.default, "even", lambda g: call(g.f(6, 8), g.f(8, 12)))
add(aten.mm.default, "odd", lambda g: call(g.f(5, 6), g.f(6, 4)))
add(aten.bmm.default, "even", lambda g: call(g.f(4, 6, 8), g.f(4, 8, 6)))
add(aten.bmm.default, "odd", lambda g: call(g.f(6, 5, 4), g.f(6, 4, 3)))
add(aten.baddbmm.default, "full", lambda g: call(g.f(4, 6, 6), g.f(4, 6, 8), g.f(4, 8, 6),
                                                 beta=0.5, alpha=2.0))
add(aten.baddbmm.default, "alibi", lambda g: call(g.f(4, 1, 6), g.f(4, 6, 8), g.f(4, 8, 6),
                                                  beta=1.0, alpha=0.25))
add(aten.baddbmm.default, "rows_broadcast", lambda g: call(g.f(6, 1), g.f(4, 6, 8),
                                                           g.f(4, 8, 6)))
add(aten.baddbmm.default, "odd", lambda g: call(g.f(6, 5, 3), g.f(6, 5, 4), g.f(6, 4, 3)))
add(aten.matmul.default, "3d_2d", lambda g: call(g.f(4, 6, 8), g.f(8, 6)))
add(aten.matmul.default, "2d_3d", lambda g: call(g.f(6, 8), g.f(4, 8, 6)))
add(aten.matmul.default, "bcast_batch", lambda g: call(g.f(2, 1, 6, 4), g.f(3, 4, 6)))
add(aten.matmul.default, "same_batch", lambda g: call(g.f(2, 6, 4, 6), g.f(2, 6, 6, 4)))
add(aten.matmul.default, "2d_2d", lambda g: call(g.f(6, 8), g.f(8, 4)))
add(aten.matmul.default, "3d_vec", lambda g: call(g.f(4, 6, 8), g.f(8)))
add(aten.matmul.default, "4d_vec", lambda g: call(g.f(2, 4, 6, 8), g.f(8)))
add(aten.matmul.default, "vec_3d", lambda g: call(g.f(8), g.f(4, 8, 6)))
add(aten.matmul.default, "vec_4d", lambda g: call(g.f(8), g.f(2, 4, 8, 6)))
add(aten.matmul.default, "2d_vec", lambda g: call(g.f(6, 8), g.f(8)))
add(aten.matmul.default, "vec_2d", lambda g: call(g.f(8), g.f(8, 6)))
add(aten.matmul.default, "vec_vec", lambda g: call(g.f(6), g.f(6)))

# ---------------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------------

add(aten.layer_norm.default, "affine", lambda g: call(g.f(4, 6, 8), [8], g.f(8), g.f(8), 1e-5,
                                                      False))
add(aten.layer_norm.default, "plain", lambda g: call(g.f(4, 6, 8), [8], None, None, 1e-5,
                                                     False))
add(aten.layer_norm.default, "weight_only", lambda g: call(g.f(6, 12), [12], g.f(12)))
add(aten.group_norm.default, "affine", lambda g: call(g.f(4, 6, 10), 3, g.f(6), g.f(6), 1e-5))
add(aten.group_norm.default, "plain_2d", lambda g: call(g.f(6, 4, 3, 5), 2))
add(aten._weight_norm.default, "conv", lambda g: call(g.f(6, 4, 5), g.f(1, 1, 5), 2))
add(aten._weight_norm.default, "rows", lambda g: call(g.f(6, 4), g.f(6, 1), 0))
add(aten._weight_norm.default, "whole", lambda g: call(g.f(6, 4), g.f(1, 1), -1))
add(aten.layer_norm.default, "two_dims", lambda g: call(g.f(6, 4, 5), [4, 5], g.f(4, 5),
                                                        g.f(4, 5)))
add(aten.rms_norm.default, "weight", lambda g: call(g.f(4, 6, 8), [8], g.f(8), 1e-6))
add(aten.rms_norm.default, "plain", lambda g: call(g.f(6, 4, 5), [5]))
add(aten.rms_norm.default, "two_dims", lambda g: call(g.f(6, 4, 5), [4, 5], g.f(4, 5)))
# BatchNorm in eval mode (running statistics: no gradient), over (N, C, L), (N, C), (N, C, H, W)
add(aten.batch_norm.default, "eval", lambda g: call(g.f(6, 12, 5), g.f(12), g.f(12), g.f(12),
                                                    g.pos(12), False, 0.1, 1e-5, False),
    no_grad=(3, 4))
add(aten.batch_norm.default, "eval_plain", lambda g: call(g.f(6, 12), None, None, g.f(12),
                                                          g.pos(12), False, 0.1, 1e-5, False),
    no_grad=(1, 2))
add(aten.batch_norm.default, "eval_2d", lambda g: call(g.f(4, 6, 2, 3), g.f(6), g.f(6), g.f(6),
                                                       g.pos(6), False, 0.1, 1e-5, False),
    no_grad=(3, 4))
# training mode without running statistics (track_running_stats=False): the batch's own
add(aten.batch_norm.default, "batch_statistics", lambda g: call(g.f(6, 4, 5), g.f(4), g.f(4),
                                                                None, None, True, 0.1, 1e-5,
                                                                False))

# training mode: the batch's statistics (summed over the ranks sharing the batch) and the
# running statistics updated (their in-place writes are not compared here)
add(aten.batch_norm.default, "training", lambda g: call(g.f(6, 6, 5), g.f(6), g.f(6), g.f(6),
                                                        g.pos(6), True, 0.1, 1e-5, False),
    no_grad=(3, 4))
add(aten.batch_norm.default, "training_2d", lambda g: call(g.f(6, 4, 3, 2), None, None,
                                                           g.f(4), g.pos(4), True, 0.1, 1e-5,
                                                           False),
    no_grad=(1, 2))

# ---------------------------------------------------------------------------------------------
# Convolutions, pooling, resampling
# ---------------------------------------------------------------------------------------------

add(aten.conv2d.default, "bias", lambda g: call(g.f(6, 6, 5, 5), g.f(12, 6, 3, 3), g.f(12),
                                                [1, 1], [1, 1]))
add(aten.conv2d.default, "no_bias_strided", lambda g: call(g.f(6, 6, 7, 7), g.f(6, 6, 3, 3),
                                                           None, [2, 2], [1, 1]))
add(aten.conv2d.default, "depthwise", lambda g: call(g.f(4, 6, 5, 5), g.f(12, 1, 3, 3),
                                                     g.f(12), [1, 1], [1, 1], [1, 1], 6))
add(aten.conv2d.default, "groups", lambda g: call(g.f(6, 4, 5, 5), g.f(6, 2, 3, 3), None,
                                                  [1, 1], [0, 0], [1, 1], 2))
add(aten.conv2d.default, "unbatched", lambda g: call(g.f(6, 5, 5), g.f(6, 6, 3, 3)))
add(aten.conv2d.padding, "same", lambda g: call(g.f(6, 6, 5, 5), g.f(6, 6, 3, 3), None, [1, 1],
                                                "same"))
# spatial shards: "same" padding, ResNet's 7x7 stem (a halo of 3 and 2 rows), a kernel
# wider than a shard of 3 ranks, a strided 1x1 shortcut (no halo), dilation
add(aten.conv2d.default, "spatial_same", lambda g: call(g.f(2, 3, 6, 12), g.f(4, 3, 3, 3),
                                                        g.f(4), [1, 1], [1, 1]))
add(aten.conv2d.default, "spatial_stem", lambda g: call(g.f(1, 3, 12, 12), g.f(4, 3, 7, 7),
                                                        None, [2, 2], [3, 3]))
add(aten.conv2d.default, "spatial_wide", lambda g: call(g.f(1, 2, 6, 6), g.f(2, 2, 7, 7),
                                                        g.f(2), [1, 1], [3, 3]))
add(aten.conv2d.default, "spatial_shortcut", lambda g: call(g.f(2, 4, 12, 12), g.f(6, 4, 1, 1),
                                                            None, [2, 2]))
add(aten.conv2d.default, "spatial_dilated", lambda g: call(g.f(1, 2, 12, 6), g.f(2, 2, 3, 3),
                                                           None, [1, 1], [2, 2], [2, 2]))
add(aten.conv1d.default, "spatial", lambda g: call(g.f(2, 3, 12), g.f(4, 3, 3), g.f(4), [1],
                                                   [1]))
add(aten.max_pool2d.default, "spatial_stem", lambda g: call(g.f(2, 3, 12, 12), [3, 3], [2, 2],
                                                            [1, 1]))
add(aten.max_pool1d.default, "spatial", lambda g: call(g.f(2, 3, 12), [2]))
add(aten.upsample_nearest2d.vec, "spatial_scale", lambda g: call(g.f(1, 2, 6, 6), None,
                                                                 [2.0, 3.0]))
add(aten.upsample_nearest2d.vec, "spatial_size", lambda g: call(g.f(1, 2, 6, 6), [12, 6],
                                                                None))
add(aten.upsample_nearest1d.vec, "spatial_uneven", lambda g: call(g.f(1, 2, 6), [9], None))
add(aten.adaptive_avg_pool2d.default, "spatial_to_one", lambda g: call(g.f(2, 3, 6, 6), [1, 1]))
add(aten.conv1d.default, "bias", lambda g: call(g.f(6, 6, 9), g.f(6, 6, 3), g.f(6)))
add(aten.conv1d.padding, "same", lambda g: call(g.f(6, 6, 9), g.f(6, 6, 3), None, [1], "same"))
add(aten.conv3d.default, "plain", lambda g: call(g.f(6, 6, 3, 4, 4), g.f(6, 6, 2, 2, 2)))
add(aten.conv3d.padding, "same", lambda g: call(g.f(6, 6, 3, 4, 4), g.f(6, 6, 3, 3, 3), None,
                                                [1, 1, 1], "same"))
add(aten.conv_transpose1d.default, "plain", lambda g: call(g.f(6, 6, 5), g.f(6, 6, 3)))
add(aten.conv_transpose2d.input, "bias_strided", lambda g: call(
    g.f(6, 6, 4, 4), g.f(6, 12, 3, 3), g.f(12), [2, 2], [1, 1], [1, 1]))
add(aten.conv_transpose3d.input, "plain", lambda g: call(g.f(6, 6, 2, 3, 3), g.f(6, 6, 2, 2, 2)))
# (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
add(aten.convolution.default, "plain", lambda g: call(
    g.f(6, 6, 5, 5), g.f(12, 6, 3, 3), g.f(12), [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
add(aten.convolution.default, "depthwise", lambda g: call(
    g.f(6, 6, 5, 5), g.f(6, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 6))
add(aten.convolution.default, "spatial", lambda g: call(
    g.f(2, 6, 6, 6), g.f(6, 6, 3, 3), g.f(6), [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
add(aten.convolution.default, "transposed", lambda g: call(
    g.f(6, 6, 4, 4), g.f(6, 6, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1))

_PLANES = {  # op: (its arguments after the input, the spatial dimensions)
    aten.max_pool1d.default: (([3], [2]), 1), aten.avg_pool1d.default: (([2],), 1),
    aten.adaptive_avg_pool1d.default: (([3],), 1), aten.adaptive_max_pool1d.default: (([3],), 1),
    aten.upsample_nearest1d.vec: ((None, [2.0]), 1),
    aten.upsample_linear1d.vec: ((None, False, [2.0]), 1),
    aten.max_pool2d.default: (([3, 3], [2, 2], [1, 1]), 2),
    aten.max_pool2d_with_indices.default: (([2, 2],), 2),
    aten.avg_pool2d.default: (([2, 2], [2, 2]), 2),
    aten.adaptive_avg_pool2d.default: (([1, 1],), 2),
    aten._adaptive_avg_pool2d.default: (([2, 3],), 2),
    aten.adaptive_max_pool2d.default: (([2, 2],), 2),
    aten.upsample_nearest2d.vec: (([10, 10], None), 2),
    aten.upsample_bilinear2d.vec: ((None, True, [2.0, 2.0]), 2),
    aten.upsample_bicubic2d.vec: (([7, 7], False, None), 2),
    aten.max_pool3d.default: (([2, 2, 2],), 3),
    aten.max_pool3d_with_indices.default: (([2, 2, 2],), 3),
    aten.avg_pool3d.default: (([2, 2, 2],), 3),
    aten.adaptive_avg_pool3d.default: (([1, 2, 2],), 3),
    aten._adaptive_avg_pool3d.default: (([1, 1, 1],), 3),
    aten.adaptive_max_pool3d.default: (([1, 2, 2],), 3),
    aten.upsample_nearest3d.vec: (([4, 8, 8], None), 3),
    aten.upsample_trilinear3d.vec: ((None, False, [1.0, 2.0, 2.0]), 3),
}
_PLANE_SHAPES = {1: (6, 6, 8), 2: (6, 6, 5, 5), 3: (6, 6, 2, 4, 4)}
for _op, (_rest, _dims) in _PLANES.items():
    add(_op, f"{_dims}d", lambda g, rest=_rest, dims=_dims: call(
        g.f(*_PLANE_SHAPES[dims]), *rest))
add(aten.max_pool2d.default, "unbatched", lambda g: call(g.f(6, 5, 5), [2, 2]))

# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

_SDPA = aten.scaled_dot_product_attention.default
add(_SDPA, "plain", lambda g: call(g.f(2, 6, 4, 8), g.f(2, 6, 4, 8), g.f(2, 6, 4, 8)))
add(_SDPA, "causal", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 6, 6, 8), g.f(2, 6, 6, 8), None,
                                    0.0, True))
add(_SDPA, "causal_rect", lambda g: call(g.f(2, 4, 6, 8), g.f(2, 4, 9, 8), g.f(2, 4, 9, 8),
                                         None, 0.0, True))
add(_SDPA, "bool_mask_2d", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 6, 5, 8), g.f(2, 6, 5, 8),
                                          _keep_a_key(g.b(6, 5))))
add(_SDPA, "float_mask_4d", lambda g: call(g.f(2, 6, 4, 8), g.f(2, 6, 5, 8), g.f(2, 6, 5, 8),
                                           g.f(2, 1, 4, 5)))
add(_SDPA, "full_mask_4d", lambda g: call(g.f(4, 6, 6, 8), g.f(4, 6, 6, 8), g.f(4, 6, 6, 8),
                                          g.f(4, 6, 6, 6)))
add(_SDPA, "gqa", lambda g: call(g.f(2, 4, 6, 8), g.f(2, 2, 6, 8), g.f(2, 2, 6, 8),
                                 enable_gqa=True))
add(_SDPA, "gqa_causal", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 3, 6, 8), g.f(2, 3, 6, 8),
                                        None, 0.0, True, enable_gqa=True))
add(_SDPA, "gqa_h4_kv2_causal", lambda g: call(g.f(2, 4, 6, 8), g.f(2, 2, 6, 8),
                                               g.f(2, 2, 6, 8), None, 0.0, True,
                                               enable_gqa=True))
add(_SDPA, "scale", lambda g: call(g.f(2, 6, 4, 8), g.f(2, 6, 4, 8), g.f(2, 6, 4, 8), None,
                                   0.0, False, scale=0.3))
add(_SDPA, "3d", lambda g: call(g.f(6, 4, 8), g.f(6, 4, 8), g.f(6, 4, 8)))


# ---------------------------------------------------------------------------------------------
# Random ops: the generator is seeded alike before the whole op and before each rank, and each
# rank's result must be the block of the whole op's, bit for bit.
# ---------------------------------------------------------------------------------------------

BF16 = torch.bfloat16
_DROPOUT, _NATIVE_DROPOUT = aten.dropout.default, aten.native_dropout.default
add(_DROPOUT, "train", lambda g: call(g.f(6, 4, 5), 0.5, True), exact=True)
add(_DROPOUT, "train_12x5", lambda g: call(g.f(12, 5), 0.1, True), exact=True)
add(_DROPOUT, "transposed", lambda g: call(g.f(5, 12).t(), 0.3, True), exact=True)
add(_DROPOUT, "f32", lambda g: call(g.f(6, 4, 5, dtype=F32), 0.2, True), exact=True)
add(_DROPOUT, "bf16", lambda g: call(g.f(6, 4, 5, dtype=BF16), 0.1, True), exact=True)
add(_DROPOUT, "eval", lambda g: call(g.f(6, 4, 5), 0.5, False))
add(_DROPOUT, "p0", lambda g: call(g.f(12, 5), 0.0, True))
add(_NATIVE_DROPOUT, "train", lambda g: call(g.f(6, 4, 5), 0.3, True), exact=True)
add(_NATIVE_DROPOUT, "train_none", lambda g: call(g.f(12, 5), 0.2, None), exact=True)
add(_NATIVE_DROPOUT, "transposed", lambda g: call(g.f(5, 12).t(), 0.5, True), exact=True)
add(_NATIVE_DROPOUT, "bf16", lambda g: call(g.f(6, 4, 5, dtype=BF16), 0.1, True), exact=True)
add(_NATIVE_DROPOUT, "eval", lambda g: call(g.f(6, 4), 0.3, False))
for _op in (aten.rand_like.default, aten.randn_like.default):
    add(_op, "6x4x5", lambda g: call(g.f(6, 4, 5)), exact=True)
    add(_op, "transposed", lambda g: call(g.f(5, 12).t()), exact=True)
    add(_op, "f32", lambda g: call(g.f(12, 5), dtype=F32), exact=True)
add(aten.randint_like.default, "float", lambda g: call(g.f(6, 4, 5), 10), (0,), True)
add(aten.randint_like.low_dtype, "float", lambda g: call(g.f(12, 5), 2, 7), (0,), True)
add(aten.randint_like.low_dtype, "int", lambda g: call(g.i(0, 5, 6, 4), -3, 9), exact=True)
add(aten.bernoulli.p, "6x4x5", lambda g: call(g.f(6, 4, 5), 0.3), (0,), True)
add(aten.bernoulli.p, "bf16", lambda g: call(g.f(12, 5, dtype=BF16), 0.7), (0,), True)

add(_SDPA, "dropout", lambda g: call(g.f(2, 6, 4, 8), g.f(2, 6, 4, 8), g.f(2, 6, 4, 8), None,
                                     0.1), exact=True)
add(_SDPA, "dropout_causal", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 6, 6, 8), g.f(2, 6, 6, 8),
                                            None, 0.3, True), exact=True)
add(_SDPA, "dropout_gqa_causal", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 3, 6, 8),
                                                g.f(2, 3, 6, 8), None, 0.2, True,
                                                enable_gqa=True), exact=True)
add(_SDPA, "dropout_bool_mask", lambda g: call(g.f(2, 6, 6, 8), g.f(2, 6, 5, 8),
                                               g.f(2, 6, 5, 8), _keep_a_key(g.b(6, 5)), 0.5),
    exact=True)
add(_SDPA, "dropout_float_mask", lambda g: call(g.f(4, 6, 6, 8), g.f(4, 6, 6, 8),
                                                g.f(4, 6, 6, 8), g.f(4, 1, 6, 6), 0.2,
                                                scale=0.3), exact=True)
add(_SDPA, "dropout_neg_scale", lambda g: call(g.f(2, 6, 4, 8), g.f(2, 6, 4, 8),
                                               g.f(2, 6, 4, 8), None, 0.1, scale=-0.2),
    exact=True)
add(_SDPA, "dropout_f32", lambda g: call(g.f(2, 6, 6, 8, dtype=F32), g.f(2, 6, 6, 8, dtype=F32),
                                         g.f(2, 6, 6, 8, dtype=F32), None, 0.1, True),
    exact=True)
add(_SDPA, "dropout_bf16", lambda g: call(g.f(2, 6, 6, 8, dtype=BF16),
                                          g.f(2, 6, 6, 8, dtype=BF16),
                                          g.f(2, 6, 6, 8, dtype=BF16), None, 0.1, True),
    exact=True)


# ---------------------------------------------------------------------------------------------
# Embedding and losses
# ---------------------------------------------------------------------------------------------

add(aten.embedding.default, "2d_idx", lambda g: call(g.f(12, 6), g.i(0, 12, 4, 6)))
add(aten.embedding.default, "1d_idx", lambda g: call(g.f(12, 5), g.i(0, 12, 6)))
add(aten.embedding.default, "odd_vocab", lambda g: call(g.f(5, 4), g.i(0, 5, 6, 3)))
add(aten.embedding.default, "padding_idx", lambda g: call(g.f(12, 6), _with_value(
    g.i(0, 12, 4, 6), 2), 2))
add(aten.embedding.default, "padding_idx_high", lambda g: call(g.f(12, 6), _with_value(
    g.i(0, 12, 4, 6), 9), 9))
add(aten.embedding.default, "scale_grad_by_freq", lambda g: call(
    g.f(12, 6), _with_value(g.i(0, 12, 6, 4), 7), -1, True))

# Lookups: one-hot rows, the expert weights each token chose, gathers along a dimension.
add(aten.one_hot.default, "2d", lambda g: call(g.i(0, 5, 6, 4), 5))
add(aten.one_hot.default, "1d", lambda g: call(g.i(0, 3, 12), 3))
add(aten.one_hot.default, "inferred", lambda g: call(g.i(0, 5, 6, 4), -1))
add(aten.index.Tensor, "rows", lambda g: call(g.f(5, 6), [g.i(0, 5, 4, 6)]), no_grad=(1,))
add(aten.index.Tensor, "experts", lambda g: call(g.f(4, 6, 8), [g.i(0, 4, 6, 2)]),
    no_grad=(1,))
add(aten.index.Tensor, "middle", lambda g: call(g.f(4, 6, 5), [None, g.i(-6, 6, 12)]),
    no_grad=(1,))
add(aten.index.Tensor, "int32", lambda g: call(g.f(6, 4), [g.i(0, 6, 12).int()]),
    no_grad=(1,))
add(aten.index.Tensor, "two_tensors", lambda g: call(g.f(6, 4), [g.i(0, 6, 12),
                                                                 g.i(0, 4, 12)]),
    no_grad=(1, 2))
add(aten.index.Tensor, "mask", lambda g: call(g.f(6, 4), [_keep_a_key(g.b(6, 4))]),
    no_grad=(1,))
add(aten.gather.default, "last", lambda g: call(g.f(6, 4, 5), 2, g.i(0, 5, 6, 4, 3)),
    no_grad=(1,))
add(aten.gather.default, "dim1", lambda g: call(g.f(6, 5), 1, g.i(0, 5, 6, 2)), no_grad=(1,))
add(aten.gather.default, "dim0_fewer", lambda g: call(g.f(6, 4), 0, g.i(0, 6, 3, 4)),
    no_grad=(1,))
add(aten.gather.default, "smaller_index", lambda g: call(g.f(6, 4, 5), 2, g.i(0, 5, 6, 2, 3)),
    no_grad=(1,))


def _targets(g: Gen, n: int, classes: int, ignored=(1, 4), ignore_index: int = -100):
    t = g.i(0, classes, n)
    for i in ignored:
        t[i] = ignore_index
    return t


_CE = aten.cross_entropy_loss.default
add(_CE, "mean", lambda g: call(g.f(6, 5), _targets(g, 6, 5)))
add(_CE, "mean_no_ignored", lambda g: call(g.f(12, 5), g.i(0, 5, 12)))
add(_CE, "mean_rank_all_ignored", lambda g: call(g.f(6, 5), _targets(g, 6, 5, (0, 1))))
add(_CE, "sum", lambda g: call(g.f(6, 5), _targets(g, 6, 5), None, 2))
add(_CE, "none", lambda g: call(g.f(6, 5), _targets(g, 6, 5), None, 0))
add(_CE, "smoothing", lambda g: call(g.f(6, 5), _targets(g, 6, 5), None, 1, -100, 0.1))
add(_CE, "ignore_index", lambda g: call(g.f(6, 5), _targets(g, 6, 5, (2,), 3), None, 1, 3))
add(_CE, "weight", lambda g: call(g.f(6, 5), _targets(g, 6, 5), g.pos(5)), no_grad=(2,))
add(_CE, "spatial", lambda g: call(g.f(4, 5, 6), g.i(0, 5, 4, 6)))
add(_CE, "prob_target", lambda g: call(g.f(6, 5), torch.softmax(g.f(6, 5), -1)))
add(_CE, "prob_target_sum", lambda g: call(g.f(6, 5), torch.softmax(g.f(6, 5), -1), None, 2))
add(_CE, "odd_batch", lambda g: call(g.f(5, 4), g.i(0, 4, 5)))

for _op, _extra in ((aten.mse_loss.default, ()), (aten.l1_loss.default, ()),
                    (aten.smooth_l1_loss.default, (0.5,)), (aten.huber_loss.default, (0.7,))):
    add(_op, "mean", lambda g, _e=_extra: call(g.f(6, 4, 5), g.f(6, 4, 5), 1, *_e))
    add(_op, "sum", lambda g, _e=_extra: call(g.f(6, 4), g.f(6, 4), 2, *_e))
    add(_op, "none", lambda g, _e=_extra: call(g.f(6, 4, 5), g.f(6, 4, 5), 0, *_e))
add(aten.mse_loss.default, "default", lambda g: call(g.f(12, 5), g.f(12, 5)))
add(aten.mse_loss.default, "bcast_target", lambda g: call(g.f(6, 4), g.f(4)))


def _rnn_weights(g: Gen, gates: int, inputs: int, hidden: int, layers: int) -> list:
    """An RNN's flat weight list (w_ih, w_hh, b_ih, b_hh per layer), as nn.GRU / nn.LSTM /
    nn.RNN pass it."""
    out = []
    for layer in range(layers):
        width = inputs if layer == 0 else hidden
        out += [g.f(gates * hidden, width), g.f(gates * hidden, hidden),
                g.f(gates * hidden), g.f(gates * hidden)]
    return out


# (input, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first)
add(aten.gru.input, "batch_first", lambda g: call(
    g.f(6, 5, 4), g.f(2, 6, 3), _rnn_weights(g, 3, 4, 3, 2), True, 2, 0.0, True, False, True))
add(aten.gru.input, "time_first", lambda g: call(
    g.f(5, 6, 4), g.f(1, 6, 3), _rnn_weights(g, 3, 4, 3, 1), True, 1, 0.0, True, False, False))
add(aten.lstm.input, "batch_first", lambda g: call(
    g.f(6, 5, 4), [g.f(1, 6, 3), g.f(1, 6, 3)], _rnn_weights(g, 4, 4, 3, 1), True, 1, 0.0,
    True, False, True))
add(aten.rnn_tanh.input, "time_first", lambda g: call(
    g.f(5, 6, 4), g.f(1, 6, 3), _rnn_weights(g, 1, 4, 3, 1), True, 1, 0.0, True, False, False))
add(aten.rnn_relu.input, "batch_first", lambda g: call(
    g.f(6, 5, 4), g.f(1, 6, 3), _rnn_weights(g, 1, 4, 3, 1), True, 1, 0.0, True, False, True))
