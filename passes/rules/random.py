"""Random ops: each rank computes its block of what the op computes on one device, in one of
two modes of randomness (`LocalContext.randomness`, the plan's `randomness`).

Counter mode ("counter"): the numbers of a random op are a function of the step's key, the op
and each element's index in the whole tensor (passes/rules/counter_rng.py), so a rank computes
its block alone, at the block's cost in memory and time. Every plan, mesh and microbatch count
of the same model draws the same numbers, equal to autopar's on one device; they are not the
numbers eager PyTorch draws. The step's key is drawn once a step from the default generator
(passes/rules/random_stream.py), so seeding every rank alike still fixes the masks.

Eager mode ("eager"), the rest of this docstring: bit for bit what eager PyTorch draws on one
device from the same seed. A random op draws a tensor of its whole shape from the default
generator. A rank that drew only its local shape would get a mask that is not the slice of the
single-device mask, and replicas that are meant to differ (data-parallel shards) would draw the
same one. So the lowering of a random op draws the whole tensor on every rank, consuming the
generator exactly as the single-device op does (the same op, shape, dtype and memory layout),
and keeps this rank's block. The local result is then the single-device result's block bit for
bit, and every rank leaves the generator in the same state, so later draws stay in step too.

Placements, per mesh dimension: the output is placed as the input, Replicate or Shard(any
dimension); never a pending sum (dropout of a sum is not the sum of dropouts), except where the
op draws nothing and is linear (dropout in eval mode or with p = 0 or 1). The ops that use only
their input's shape (rand_like, randn_like, randint_like, bernoulli with a scalar probability)
also take a pending sum as their input.

Gradient accumulation runs a program traced on one of m microbatches m times. There a random
op whose output carries the batch (`LocalContext.microbatches`: on which dimension) draws the
whole batch's tensor and keeps its block of the microbatch the runtime runs now
(`STREAM.microbatch`), and the runtime puts the generator back where the step started before
each microbatch and where the first one left it after the last: every microbatch draws what
the whole batch draws, as one device running the whole batch does, and keeps its rows.

Cost (solver/cost.py, solver/memory.py): in eager mode the draw is of the whole tensor on
every rank whatever the sharding; in counter mode of the rank's block, in chunks. What backward
keeps is the local block of the mask.
"""

from __future__ import annotations

import operator

import torch

from ..emitted import META_KEY
from ..placement import local_slices
from ..trace import draws_random, source_line
from . import counter_rng
from .random_stream import STREAM
from .registry import (
    SAVES_NOTHING,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    TensorArg,
    aten,
    facts,
    lowering,
    register,
)

DROPOUT = aten.dropout.default
NATIVE_DROPOUT = aten.native_dropout.default
# Ops that draw a tensor of their input's shape and read nothing else of the input.
DRAWN_LIKE = [aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
              aten.randint_like.low_dtype, aten.bernoulli.p]
RANDOM_OPS = [DROPOUT, NATIVE_DROPOUT, *DRAWN_LIKE]
# Devices where aten.dropout uses the fused native_dropout kernel (ATen's
# `is_fused_kernel_acceptable` in aten/src/ATen/native/Dropout.cpp); elsewhere it multiplies by
# `empty_like(input).bernoulli_(1 - p).div_(1 - p)`.
FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")

__all__ = ["DRAWN_LIKE", "RANDOM_OPS", "REPLAYS", "counter_dropout_block", "counter_traffic",
           "draw_mask", "drawn_dtype", "draws_of", "dropout_draws", "replay"]


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------

def _placements(x: TensorArg) -> list:
    """Shard(d) for every dimension that can be split, and Replicate."""
    return [Shard(d) for d in range(x.ndim) if x.shape[d] > 1] + [R]


def dropout_draws(call: OpCall) -> bool:
    """Whether a dropout call draws a mask (training with 0 < p < 1 on a non-empty tensor);
    otherwise it is the identity (or, with p = 1, zero) and draws nothing."""
    p, train = call.arg(1, "p", 0.5), call.arg(2, "train", True)
    if call.target == NATIVE_DROPOUT:
        # native_dropout draws whenever it trains (train None means training), p = 0 or 1 too.
        return train is not False and all(call.inputs[0].shape)
    return bool(train) and 0 < p < 1 and all(call.inputs[0].shape)


def drawn_elements(call: OpCall) -> int:
    """Elements a random op draws on every rank, whatever its sharding (0 if it draws none)."""
    if call.target in (DROPOUT, NATIVE_DROPOUT) and not dropout_draws(call):
        return 0
    n = 1
    for s in call.out_shapes[0]:
        n *= s
    return n


def _mask_bytes(call: OpCall, in_local, out_local, itemsize) -> float:
    """Dropout keeps the block of its mask: one byte per element (the boolean mask of GPU
    dropout; on a CPU it is a tensor of the input's dtype)."""
    n = 1
    for s in out_local[0]:
        n *= s
    return float(n) if dropout_draws(call) else 0.0


facts(DROPOUT, NATIVE_DROPOUT, saves=SAVES_NOTHING, extra_saved=_mask_bytes,
      draws=drawn_elements)
facts(*DRAWN_LIKE, saves=SAVES_NOTHING, draws=drawn_elements)


@register(DROPOUT)
def dropout(call: OpCall) -> list[Rule1D]:
    """The output placed as the input; a pending sum passes only where nothing is drawn."""
    rules = [Rule1D((o,), o) for o in _placements(call.inputs[0])]
    if not dropout_draws(call):
        rules.append(Rule1D((P,), P))
    return rules


@register(NATIVE_DROPOUT)
def native_dropout(call: OpCall) -> list[Rule1D]:
    """Output and mask placed as the input. In eval mode (train=False) the output is the input
    and the mask all ones, so a pending sum passes (the mask is the same on every rank)."""
    rules = [Rule1D((o,), (o, o)) for o in _placements(call.inputs[0])]
    if call.arg(2, "train", None) is False:
        rules.append(Rule1D((P,), (P, R)))
    return rules


@register(*DRAWN_LIKE)
def drawn_like(call: OpCall) -> list[Rule1D]:
    """The output Replicate or Shard(d); the input placed alike, or a pending sum (only its
    shape is read)."""
    rules = []
    for o in _placements(call.inputs[0]):
        rules += [Rule1D((o,), o), Rule1D((P,), o)]
    return rules


# ---------------------------------------------------------------------------------------------
# Lowerings: draw whole, keep the block
# ---------------------------------------------------------------------------------------------

def _layout(x: TensorArg) -> tuple[int, ...]:
    """The strides of `empty_like` of the single-device input: the memory order in which the
    single-device op fills its draw (the values depend on it)."""
    meta = torch.empty(x.shape, device="meta") if x.stride is None else \
        torch.empty_strided(x.shape, x.stride, device="meta")
    return tuple(torch.empty_like(meta).stride())


def _block(call: OpCall, ctx: LocalContext) -> tuple[tuple[int, int], ...]:
    """(start, length) per dimension of this rank's block of the (first) output."""
    out = ctx.out_placements[0] if call.multi_output else ctx.out_placements
    return tuple(local_slices(call.out_shapes[0], out, ctx.mesh_shape, ctx.coords))


def _stand_in(like: torch.Tensor, shape: tuple[int, ...], layout: tuple[int, ...]
              ) -> torch.Tensor:
    """An uninitialized tensor of the whole shape and the single-device layout."""
    return torch.empty_strided(shape, layout, dtype=like.dtype, device=like.device)


def _whole_batch(call: OpCall, ctx: LocalContext):
    """(shape, layout, block, shift) of the draw: the input's whole shape and the
    single-device layout, this rank's block of the output, and under gradient accumulation
    (dimension, rows of a microbatch): the shape and layout are the whole batch's, the block
    is moved by the rows of the microbatches before the one running (`STREAM.shifted`)."""
    x = call.inputs[0]
    block = _block(call, ctx)
    if ctx.microbatches is None:
        return x.shape, _layout(x), block, None
    d, m = ctx.microbatches
    shape = tuple(s * m if k == d else s for k, s in enumerate(x.shape))
    strides = _layout(x)
    order = sorted(range(x.ndim), key=lambda k: strides[k])  # innermost first
    layout, step = [0] * x.ndim, 1
    for k in order:  # the whole batch in the input's memory order
        layout[k] = step
        step *= shape[k]
    return shape, tuple(layout), block, (d, x.shape[d])


def _take(whole: torch.Tensor, block: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This rank's block of a whole draw, in storage of its own (so the whole draw is freed
    once this op has run: autograd keeps only the block)."""
    if all(length == size for (_, length), size in zip(block, whole.shape)):
        return whole
    for d, (start, length) in enumerate(block):
        if length != whole.shape[d]:
            whole = whole.narrow(d, start, length)
    return whole.clone()


def _fused(x: torch.Tensor) -> bool:
    return x.device.type in FUSED_DROPOUT_DEVICES


def _scale(p: float) -> float:
    """1 / (1 - p) as native_dropout's derivative and its CPU kernel compute it (0 for p = 1)."""
    return 0.0 if p == 1 else 1.0 / (1.0 - p)


def _fused_scale(x: torch.Tensor, p: float) -> float:
    """The scale the fused GPU kernel multiplies by: `accscalar_t(1) / accscalar_t(1 - p)`,
    in float32 unless the tensor is float64."""
    if not _fused(x) or x.dtype == torch.float64 or p == 1:
        return _scale(p)
    keep = torch.tensor(1.0 - p, dtype=torch.float32)
    return float(torch.tensor(1.0, dtype=torch.float32) / keep)


class _MaskAndScale(torch.autograd.Function):
    """x * mask / (1 - p) computed as native_dropout computes its output on x's device, with
    native_dropout's backward: native_dropout_backward(grad, mask, backward_scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, p: float,
                backward_scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.backward_scale = backward_scale
        if _fused(x):
            return aten.native_dropout_backward(x, mask, _fused_scale(x, p))
        # ATen's CPU kernel multiplies by the scale in the input's dtype (bfloat16: rounded).
        return x.mul(mask).mul_(torch.tensor(_scale(p), dtype=x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return aten.native_dropout_backward(grad, mask, ctx.backward_scale), None, None, None


def dropout_block(x: torch.Tensor, p: float, shape: tuple[int, ...], layout: tuple[int, ...],
                  block: tuple[tuple[int, int], ...], shift=None) -> torch.Tensor:
    """aten.dropout(x, p, train=True) of this rank's block `x` of the whole input (`shift`:
    see `_whole_batch`)."""
    block = STREAM.shifted(block, shift)
    if _fused(x):
        _, mask = aten.native_dropout(_stand_in(x, shape, layout), p, True)
        return _MaskAndScale.apply(x, _take(mask, block), p, _scale(p))
    noise = _stand_in(x, shape, layout).bernoulli_(1 - p).div_(1 - p)
    return x.mul(_take(noise, block))


def native_dropout_block(x: torch.Tensor, p: float, train: bool | None,
                         shape: tuple[int, ...], layout: tuple[int, ...],
                         block: tuple[tuple[int, int], ...], shift=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """aten.native_dropout(x, p, train) of this rank's block `x` of the whole input."""
    _, mask = aten.native_dropout(_stand_in(x, shape, layout), p, train)
    mask = _take(mask, STREAM.shifted(block, shift))
    # native_dropout's derivative scales by 1, not 1 / (1 - p), when train is None (it reads
    # "not train.has_value() or not train" as eval mode); the single-device gradient does too.
    return _MaskAndScale.apply(x, mask, p, 1.0 if train is None else _scale(p)), mask


def drawn_like_block(op, x: torch.Tensor, args: tuple, kwargs: dict, shape: tuple[int, ...],
                     layout: tuple[int, ...], block: tuple[tuple[int, int], ...],
                     shift=None) -> torch.Tensor:
    """`op(x, *args, **kwargs)` (rand_like and the like) of this rank's block `x`."""
    return _take(op(_stand_in(x, shape, layout), *args, **kwargs), STREAM.shifted(block, shift))


# ---------------------------------------------------------------------------------------------
# Counter mode: each rank computes its block from the step's key
# ---------------------------------------------------------------------------------------------

class _Kept(torch.autograd.Function):
    """x where `mask` keeps it (else 0) times `scale`, and the same of the gradient times
    `backward_scale`: dropout without a temporary of the input's size (a product with the
    boolean mask would first cast it to the input's dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float,
                backward_scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.backward_scale = backward_scale
        return torch.where(mask, x, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, grad, 0.0).mul_(ctx.backward_scale), None, None, None


def counter_dropout_block(x: torch.Tensor, p: float, name: str, shape: tuple[int, ...],
                          block: tuple[tuple[int, int], ...], shift=None) -> torch.Tensor:
    """Dropout of this rank's block `x` of the whole input (of `shape`): the keep mask of
    the block, computed from the key of op `name` this step (counter_rng.keep_mask)."""
    mask = counter_rng.keep_mask(STREAM.op_key(name), p, shape, STREAM.shifted(block, shift),
                                 x.device)
    return _Kept.apply(x, mask, _scale(p), _scale(p))


def counter_native_dropout_block(x: torch.Tensor, p: float, train: bool | None, name: str,
                                 shape: tuple[int, ...], block: tuple[tuple[int, int], ...],
                                 shift=None) -> tuple[torch.Tensor, torch.Tensor]:
    """aten.native_dropout(x, p, train) of this rank's block, with the counter mask."""
    mask = counter_rng.keep_mask(STREAM.op_key(name), p, shape, STREAM.shifted(block, shift),
                                 x.device)
    return _Kept.apply(x, mask, _scale(p), 1.0 if train is None else _scale(p)), mask


def counter_drawn_like_block(op, x: torch.Tensor, args: tuple, kwargs: dict, name: str,
                             shape: tuple[int, ...], block: tuple[tuple[int, int], ...],
                             shift=None) -> torch.Tensor:
    """`op(x, *args, **kwargs)` (rand_like, randn_like, randint_like, bernoulli(x, p)) of this
    rank's block `x`, drawn from the key of op `name` this step."""
    kw = {k: v for k, v in kwargs.items() if k not in ("device", "generator")}
    dtype = op(torch.empty(0, dtype=x.dtype, device="meta"), *args, **kw).dtype
    key, block = STREAM.op_key(name), STREAM.shifted(block, shift)
    if op == aten.randn_like.default:
        return counter_rng.normal(key, STREAM.op_key(name, 1), shape, block, dtype, x.device)
    if op in (aten.randint_like.default, aten.randint_like.low_dtype):
        low, high = (0, args[0]) if op == aten.randint_like.default else args[:2]
        return counter_rng.integers(key, int(low), int(high), shape, block, dtype, x.device)
    if op == aten.bernoulli.p:
        u = counter_rng.uniform(key, shape, block, torch.float64 if dtype == torch.float64
                                else torch.float32, x.device)
        return (u < float(args[0] if args else kwargs.get("p", 0.5))).to(dtype)
    # in the dtype's own bits: exact there, never rounded up to 1
    return counter_rng.uniform(key, shape, block, dtype, x.device)


def counter_traffic(call: OpCall) -> float:
    """Bytes of memory traffic per element a counter draw of `call` moves (unfused): a mask
    for dropout and SDPA's dropout, numbers for the others (counter_rng)."""
    masks = (DROPOUT, NATIVE_DROPOUT, aten.scaled_dot_product_attention.default)
    return counter_rng.MASK_TRAFFIC if call.target in masks else counter_rng.NUMBER_TRAFFIC


def _counter(call: OpCall, ctx: LocalContext) -> tuple:
    """(name, whole shape, block, shift) of a counter-mode draw (`_whole_batch`, without the
    layout: counter numbers follow the logical index, not memory order)."""
    shape, _, block, shift = _whole_batch(call, ctx)
    return call.name, shape, block, shift


# Where the op draws, the lowering draws from a stand-in even when the rank holds the whole
# tensor: the local input may be laid out differently from the single-device one (a collective
# returns it contiguous), and the draw follows the layout.

@lowering(DROPOUT, NATIVE_DROPOUT)
def lower_dropout(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Draw the whole mask, keep the block (of output, and of the mask native_dropout returns);
    the unchanged op where nothing is drawn."""
    if not dropout_draws(call):
        return call.target, args, kwargs
    head = (args[0] if args else kwargs["input"], float(call.arg(1, "p")))
    if ctx.randomness == "counter":
        if call.target == NATIVE_DROPOUT:
            return counter_native_dropout_block, (*head, call.arg(2, "train", None),
                                                  *_counter(call, ctx)), {}
        return counter_dropout_block, (*head, *_counter(call, ctx)), {}
    tail = _whole_batch(call, ctx)
    if call.target == NATIVE_DROPOUT:
        return native_dropout_block, (*head, call.arg(2, "train", None), *tail), {}
    return dropout_block, (*head, *tail), {}


@lowering(*DRAWN_LIKE)
def lower_drawn_like(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Draw the whole tensor from a stand-in of the whole input, keep the block (counter
    mode: compute the block)."""
    if ctx.randomness == "counter":
        return counter_drawn_like_block, (call.target, args[0], tuple(args[1:]), dict(kwargs),
                                          *_counter(call, ctx)), {}
    return drawn_like_block, (call.target, args[0], tuple(args[1:]), dict(kwargs),
                              *_whole_batch(call, ctx)), {}


# ---------------------------------------------------------------------------------------------
# Replays: move a generator past the draws of programs another rank runs (pipeline stages)
# ---------------------------------------------------------------------------------------------

def drawn_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype of what a lowered random op returns, which is its input's (rand_like with a
    dtype= of its own passes it on): from the rewrite's record of it, or of its first output
    (native_dropout returns two)."""
    for n in (node, *(u for u in node.users if u.target is operator.getitem and u.args[1] == 0)):
        record = n.meta.get(META_KEY)
        if getattr(record, "dtype", None) is not None:
            return record.dtype
    return None


def draw_mask(dtype: torch.dtype | None, device: torch.device, p: float,
              shape: tuple[int, ...], layout: tuple[int, ...]) -> None:
    """Draw, and discard, what `aten.dropout(x, p, True)` draws for an `x` of `shape`,
    `layout`, `dtype` on `device`."""
    like = torch.empty(0, dtype=dtype, device=device)
    if _fused(like):
        aten.native_dropout(_stand_in(like, shape, layout), p, True)
    else:
        _stand_in(like, shape, layout).bernoulli_(1 - p)


def _replay_dropout(node: torch.fx.Node, device: torch.device) -> None:
    p, shape, layout = node.args[1:4]
    draw_mask(drawn_dtype(node), device, p, shape, layout)


def _replay_native_dropout(node: torch.fx.Node, device: torch.device) -> None:
    _, p, train, shape, layout = node.args[:5]
    like = torch.empty(0, dtype=drawn_dtype(node), device=device)
    aten.native_dropout(_stand_in(like, shape, layout), p, train)


def _replay_drawn_like(node: torch.fx.Node, device: torch.device) -> None:
    op, _, args, kwargs, shape, layout = node.args[:6]
    dtype = drawn_dtype(node) if "dtype" not in kwargs else None  # (else: the input's)
    like = torch.empty(0, dtype=dtype, device=device)
    op(_stand_in(like, shape, layout), *args, **kwargs)


# lowered random op -> its replay (the lowerings pass every argument a draw reads as a value)
REPLAYS: dict = {dropout_block: _replay_dropout, native_dropout_block: _replay_native_dropout,
                 drawn_like_block: _replay_drawn_like}


def draws_of(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], str]:
    """The nodes of a rank's program (lowered) that draw random numbers, in the order they
    run, and "" or why one of them cannot be replayed (`replay`): an op drawing in a kernel
    of its own (SDPA's fused dropout, noise of a shape of its own). The ops of a submodule's
    program (a run recomputed in backward: passes/recompute_regions.py) count where it is
    called."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            inner = next((m for m in gm.get_submodule(node.target).modules()
                          if isinstance(m, torch.fx.GraphModule)), None)
            if inner is not None:
                nodes, why = draws_of(inner)
                out += nodes
                if why:
                    return out, why
            continue
        if node.op != "call_function":
            continue
        if node.target in REPLAYS:
            out.append(node)
        elif draws_random(node):
            line = source_line(node)
            return out, (f"{node.target}{f' ({line})' if line else ''} draws random numbers "
                         "in a kernel of its own")
    return out, ""


def replay(node: torch.fx.Node, device: torch.device) -> None:
    """Draw from `device`'s default generator what `node` (of `draws_of`) draws when it runs,
    discarding the numbers: the generator moves on exactly as the op moves it."""
    REPLAYS[node.target](node, device)
