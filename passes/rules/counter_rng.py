"""Counter-based random numbers: the value at each element of a random tensor is a function of
(the op's key, the element's index in the whole tensor), so any block of the tensor is drawn on
its own, at the cost of the block, and equals that block of the whole draw.

This is the idea of JAX's partitionable threefry (random bits as a function of key and global
index) with SplitMix64 as the function: the bits of element i of a draw with key k are
`mix64(k + (i + 1) * GAMMA)`, the output of Java's SplittableRandom seeded with k at step i, a
generator that passes BigCrush. It is computed with int64 tensor ops (wrapping multiplication,
logical shifts emulated by arithmetic shift and mask), on any device, in chunks of at most
CHUNK elements so that what a draw holds besides its result is bounded by a constant.

An op's key comes from the step's key (drawn once a step from the default generator:
passes/rules/random_stream.py) and the op's name in the traced program, so two ops of a step,
and two steps, draw independent numbers, and every plan of the same model draws the same ones.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["CHUNK", "DRAW_BYTES_PER_ELEMENT", "GAMMA", "MASK_TRAFFIC", "NUMBER_TRAFFIC", "bits",
           "integers", "keep_mask", "normal", "op_key", "python_bits", "python_keep", "uniform"]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Elements drawn at once: a chunk's int64 index, its bits and a temporary are live.
CHUNK = 1 << 22
DRAW_BYTES_PER_ELEMENT = 24
# Bytes of memory traffic per element, unfused (each kernel reads and writes its int64s): a
# number (`bits`: the index, 3 kernels keying it, 11 mixing it, 2 or 3 making the number) and
# a dropout mask (`keep_mask`: a quarter of a number's hashing, then 2 kernels on int16 lanes)
NUMBER_TRAFFIC = 17 * 16.0
MASK_TRAFFIC = 15 * 16.0 / 4 + 7.0

Block = tuple[tuple[int, int], ...]  # (start, length) per dimension of the whole tensor


def _signed(c: int) -> int:
    """`c` (mod 2**64) as the int64 holding the same bits."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 `z` by `s` bits (torch shifts int64 arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _hash_(counters: torch.Tensor, key: int) -> torch.Tensor:
    """The 64 random bits of each of `counters` (int64 element or word indices, overwritten
    in place): `mix64(key + (counter + 1) * GAMMA)`."""
    return _mix64_(counters.add_(1).mul_(_signed(GAMMA)).add_(_signed(key)))


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer (Stafford's Mix13) on int64 `z`, elementwise, wrapping, in place,
    with one temporary (fresh tensors cost page faults on a CPU)."""
    t = torch.empty_like(z)
    for shift, factor in ((30, _signed(_M1)), (27, _signed(_M2)), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
        if factor is not None:
            z.mul_(factor)
    return z


def _mix_int(z: int) -> int:
    """`_mix64_` on one Python integer (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def python_bits(key: int, index: int) -> int:
    """The 64 random bits of element `index` of a draw with `key`, in plain Python: the
    definition the tensor code (`bits`) must match."""
    return _mix_int(key + (index + 1) * GAMMA)


def op_key(step_key: int, name: str, stream: int = 0) -> int:
    """The key of the op named `name` in the traced program, in the step whose key is
    `step_key` (`stream` numbers further independent draws of the same op)."""
    return _mix_int(_mix_int(step_key) ^ _mix_int(zlib.crc32(name.encode()) + stream * GAMMA))


def _chunks(block: Block) -> Iterator[Block]:
    """`block` cut into blocks of at most CHUNK elements, in row-major order: the first
    dimension longer than one is split into runs of rows, a row too large cut again."""
    size = math.prod(n for _, n in block)
    if size <= CHUNK:
        yield block
        return
    d = next(k for k, (_, n) in enumerate(block) if n > 1)
    inner = math.prod(n for _, n in block[d + 1:])
    rows = max(1, CHUNK // max(inner, 1))
    start, n = block[d]
    for s in range(start, start + n, rows):
        yield from _chunks((*block[:d], (s, min(rows, start + n - s)), *block[d + 1:]))


def _index(shape: tuple[int, ...], block: Block, device) -> torch.Tensor:
    """The row-major index in a whole tensor of `shape` of each element of `block` (int64,
    the block's shape)."""
    lengths = tuple(n for _, n in block)
    first, count = _run(shape, block)
    if count is not None:  # one run of the whole tensor
        return torch.arange(first, first + count, dtype=torch.int64, device=device).view(lengths)
    index = torch.full(lengths, first, dtype=torch.int64, device=device)
    for d, (_, n) in enumerate(block):
        if n > 1:
            k = math.prod(shape[d + 1:])
            ax = torch.arange(0, n * k, k, dtype=torch.int64, device=device)
            index.add_(ax.view(n, *([1] * (len(shape) - 1 - d))))
    return index


def bits(key: int, shape: tuple[int, ...], block: Block, device) -> torch.Tensor:
    """The 64 random bits (int64) of each element of `block` of a draw of `shape` with `key`
    (one chunk: callers go through `_draw`)."""
    return _hash_(_index(shape, block, device), key)


def _draw(key: int, shape: tuple[int, ...], block: Block, dtype: torch.dtype, device,
          fn: Callable[[torch.Tensor, Block], torch.Tensor]) -> torch.Tensor:
    """A tensor of `block`'s shape and `dtype`: `fn(bits, chunk)` of each chunk's bits."""
    out = torch.empty(tuple(n for _, n in block), dtype=dtype, device=device)
    for chunk in _chunks(block):
        where = tuple(slice(c - b, c - b + n) for (c, n), (b, _) in zip(chunk, block))
        out[where] = fn(bits(key, shape, chunk, device), chunk)
    return out


def keep_mask(key: int, p: float, shape: tuple[int, ...], block: Block, device
              ) -> torch.Tensor:
    """Dropout's boolean keep mask of `block`: element i is kept where the 16 bits of lane
    i mod 4 of word i div 4 (bits 16 (i mod 4) to 16 (i mod 4) + 15 of the word's 64 random
    bits) are at least ceil(p * 2**16), with probability 1 - p to 2**-16
    (`python_keep`). Four elements share one word's bits, so a mask costs a quarter of the
    hashing: a block that is one run of the whole tensor reads the words' bits as int16
    lanes directly; any other block computes each element's lane."""
    threshold = math.ceil(p * 2**16)
    lengths = tuple(n for _, n in block)
    if threshold <= 0 or threshold >= 2**16:
        return torch.full(lengths, threshold <= 0, dtype=torch.bool, device=device)
    first, count = _run(shape, block)
    if count is None or sys.byteorder != "little":
        return _draw(key, shape, block, torch.bool, device,
                     lambda _, chunk: _lanes(key, shape, chunk, device) >= threshold)
    out = torch.empty(lengths, dtype=torch.bool, device=device)
    flat = out.view(-1)
    words = max(1, CHUNK // 4)
    for w in range(first // 4, (first + count - 1) // 4 + 1, words):
        end = min(w + words, (first + count - 1) // 4 + 1)
        words_bits = _hash_(torch.arange(w, end, dtype=torch.int64, device=device), key)
        lanes = words_bits.view(torch.int16)
        # unsigned lane >= threshold, compared as signed int16 with the sign bit flipped
        keep = lanes.bitwise_xor_(-(2**15)) >= threshold - 2**15
        a, b = max(4 * w, first), min(4 * end, first + count)
        flat[a - first:b - first] = keep[a - 4 * w:b - 4 * w]
    return out


def _run(shape: tuple[int, ...], block: Block) -> tuple[int, int | None]:
    """(row-major index of `block`'s first element, its elements when the block is one run
    of the whole tensor, else None)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(s * k for (s, _), k in zip(block, strides))
    last = sum((s + n - 1) * k for (s, n), k in zip(block, strides))
    count = math.prod(n for _, n in block)
    return first, count if last - first + 1 == count else None


def _lanes(key: int, shape: tuple[int, ...], block: Block, device) -> torch.Tensor:
    """The 16 bits of each element's lane (`keep_mask`), as int64 in [0, 2**16)."""
    index = _index(shape, block, device)
    lane = index.bitwise_and(3).mul_(16)
    z = _hash_(index.bitwise_right_shift_(2), key)
    return torch.bitwise_right_shift(z, lane).bitwise_and_(0xFFFF)


def python_keep(key: int, p: float, index: int) -> bool:
    """Whether element `index` of a dropout mask with `key` is kept, in plain Python: the
    definition `keep_mask` must match."""
    lanes = python_bits(key, index // 4)
    return (lanes >> (16 * (index % 4))) & 0xFFFF >= math.ceil(p * 2**16)


def _fraction_bits(dtype: torch.dtype) -> int:
    """Random bits a uniform number of `dtype` in [0, 1) holds exactly."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))


def uniform(key: int, shape: tuple[int, ...], block: Block, dtype: torch.dtype, device
            ) -> torch.Tensor:
    """Uniform numbers in [0, 1) of `dtype` (multiples of 2**-b, b the dtype's significand
    bits: exact in the dtype, never 1)."""
    b = _fraction_bits(dtype)
    work = torch.float64 if b > 24 else torch.float32
    return _draw(key, shape, block, dtype, device,
                 lambda z, _: _shr(z, 64 - b).to(work).mul_(2.0 ** -b))


def normal(key: int, key2: int, shape: tuple[int, ...], block: Block, dtype: torch.dtype,
           device) -> torch.Tensor:
    """Standard normal numbers (Box-Muller of two uniforms, drawn with `key` and `key2`),
    computed in float64 for float64 and in float32 otherwise."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    b = 53 if work == torch.float64 else 24

    def one(z: torch.Tensor, chunk: Block) -> torch.Tensor:
        u1 = _shr(z, 64 - b).to(work).mul_(2.0 ** -b)
        u2 = _shr(bits(key2, shape, chunk, device), 64 - b).to(work).mul_(2.0 ** -b)
        return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2 * math.pi) * u2)

    return _draw(key, shape, block, dtype, device, one)


def integers(key: int, low: int, high: int, shape: tuple[int, ...], block: Block,
             dtype: torch.dtype, device) -> torch.Tensor:
    """Integers in [low, high) (the high 63 bits modulo high - low)."""
    span = high - low
    return _draw(key, shape, block, dtype, device,
                 lambda z, _: _shr(z, 1).remainder_(span).add_(low))
