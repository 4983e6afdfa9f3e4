"""How much of a device's peak an op reaches: matrix products by shape, attention by its fused
kernel, everything else by memory bandwidth. A leaf of the solver: the cost model reads it.

The figures live in the hardware profile (autopar.hardware, with their sources there); this
module turns them into seconds for one op on its local shapes:

- Matrix products (linear, mm, bmm, addmm, matmul): peak x `matmul_efficiency` (the largest
  share of peak any well-shaped GEMM reaches, the "maximum achievable matmul FLOPS") x the
  quantization losses NVIDIA's GEMM performance guide describes ("Matrix Multiplication
  Background User's Guide", docs.nvidia.com/deeplearning/performance). The output is cut
  into tiles (the best of `gemm_tiles` for the shape, as cuBLAS's heuristics pick) and a
  partial tile costs a whole one (tile quantization); the tiles run in waves of one per SM
  and a partial last wave costs a whole one (wave quantization), unless the reduction is
  split over more tiles (split-K, which cuBLAS and CUTLASS use for small outputs with long
  reductions: each split is a tile of its own over a part of K); and every tile pays a fixed
  pipeline fill of `gemm_k_overhead` inner elements, so a short reduction K runs at
  K / (K + overhead) of the rate. These losses are relative to the shape where the maximum
  was measured (`matmul_best_shape`), so that shape reaches exactly the maximum and none
  exceeds it. Where the profile holds measured shares (`gemm_measured`, autopar.measured:
  measured on the GPU itself), the analytic share is scaled by the measured / analytic ratio
  interpolated from the nearest measured shapes: the shape dependence cuBLAS's kernels have
  beyond quantization (wide and narrow outputs, huge reductions) comes from measurement.
  Small and skinny GEMMs (a few rows of a microbatch, a narrow tensor-parallel
  shard) reach far less of peak than large square ones. A product is never faster than
  reading its operands and writing its output at the achievable memory bandwidth.
- Attention (SDPA): the fused kernel's measured throughput by sequence length (`attention`,
  flop/s per (kv length) point for forward, causal forward and backward), interpolated in
  log2 of the length, in the flops convention of the FlashAttention papers (a causal mask
  counts half), which autopar's attention flops follow.
- Everything else: bytes moved / (memory bandwidth x `memory_efficiency`), or flops at peak
  when that is larger (the roofline).

A profile without these figures (the CPU profile: 0 SMs, efficiency 1, no attention table)
prices every op on the plain roofline.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

__all__ = ["attention_rate", "matmul_efficiency", "product_dims"]


def product_dims(a: Sequence[int], b: Sequence[int], out: Sequence[int]) -> tuple[int, int, int]:
    """(M, N, K) of a product on local shapes: `a` (..., K) times `b` into `out` (..., N); M
    folds every leading dimension of the output (batch, sequence, bmm's batch) into rows."""
    k = a[-1] if a else 1
    n = out[-1] if out else 1
    m = math.prod(out[:-1]) if len(out) > 1 else 1
    return m, n, k


def matmul_efficiency(hw, m: int, n: int, k: int) -> float:
    """Share of `hw`'s peak a GEMM of M x K times K x N reaches: the achievable maximum
    times tile, wave and K-pipeline quantization (module docstring). 1 for profiles without
    SM figures (CPUs)."""
    eff = hw.matmul_efficiency
    if not hw.sm_count or min(m, n, k) <= 0:
        return eff
    share = _analytic(hw, m, n, k)
    if hw.gemm_measured:
        share = min(1.0, share * _measured_ratio(hw, m, n, k))
    return share


def _analytic(hw, m: int, n: int, k: int) -> float:
    """The achievable maximum times quantization, relative to the shape it was measured at."""
    reference = _quantized(hw, *hw.matmul_best_shape) if all(hw.matmul_best_shape) else 1.0
    return hw.matmul_efficiency * min(1.0, _quantized(hw, m, n, k) / reference)


def _measured_ratio(hw, m: int, n: int, k: int) -> float:
    """Measured / analytic share near (M, N, K): the geometric mean of the ratios at the
    profile's measured shapes (`gemm_measured`), weighted by 1 / (d^2 + 1/4)^2 with d the
    distance in log2 of (M, N, K), so that a measured shape's own ratio dominates there
    and its neighbours' between them."""
    key = (id(hw.gemm_measured), id(hw.gemm_tiles), hw.matmul_efficiency, hw.sm_count,
           hw.gemm_k_overhead, tuple(hw.matmul_best_shape))
    entry = _MEASURED.get(key)
    if entry is None:  # the entry keeps the tuples whose ids key it alive
        entry = _MEASURED[key] = (hw.gemm_measured, hw.gemm_tiles, _ratios(hw), {})
    memo = entry[3]
    got = memo.get((m, n, k))
    if got is None:
        x = (math.log2(m), math.log2(n), math.log2(k))
        num = den = 0.0
        for p, log_ratio in entry[2]:
            d2 = (x[0] - p[0]) ** 2 + (x[1] - p[1]) ** 2 + (x[2] - p[2]) ** 2
            w = 1.0 / (d2 + 0.25) ** 2
            num += w * log_ratio
            den += w
        got = memo[m, n, k] = math.exp(num / den)
    return got


# measured ratios per profile (keyed by its measured and tile tuples and analytic figures),
# with the ratio of each shape priced so far: a plan prices the same few shapes many times
_MEASURED: dict[tuple, tuple] = {}


def _ratios(hw) -> tuple:
    """(log2 (M, N, K), log of measured / analytic share) of each measured shape."""
    return tuple(((math.log2(m), math.log2(n), math.log2(k)),
                  math.log(share / _analytic(hw, m, n, k)))
                 for m, n, k, share in hw.gemm_measured)


def _quantized(hw, m: int, n: int, k: int) -> float:
    """Useful share of a GEMM's work after tile, wave and K-pipeline quantization."""
    return _quantize(hw.sm_count, tuple(map(tuple, hw.gemm_tiles)), hw.gemm_k_overhead, m, n, k)


@functools.lru_cache(maxsize=None)  # a plan prices the same few shapes at every level
def _quantize(sms: int, tiles: tuple, k_overhead: float, m: int, n: int, k: int) -> float:
    best = 0.0
    split = 1
    while split == 1 or k / split >= 2 * k_overhead:
        kk = k / split
        fill = max(_tiling(m, n, tm, tn, sms, split) for tm, tn in tiles)
        best = max(best, fill * kk / (kk + k_overhead))
        split *= 2
    return best


def _tiling(m: int, n: int, tm: int, tn: int, sms: int, split: int = 1) -> float:
    """Useful share of the work the tiles of a wave-quantized M x N output do, each tile's
    reduction split `split` ways."""
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    tile_fill = m * n / (tiles_m * tiles_n * tm * tn)
    tiles = tiles_m * tiles_n * split
    waves = math.ceil(tiles / sms)
    wave_fill = tiles / (waves * sms)
    return tile_fill * wave_fill


def attention_rate(hw, kv_length: int, *, causal: bool, backward: bool) -> float | None:
    """Flop/s the fused attention kernel reaches at `kv_length` keys (None: the profile has
    no attention figures; price on the matmul efficiency)."""
    table = hw.attention.get("backward" if backward else
                             "forward_causal" if causal and "forward_causal" in hw.attention
                             else "forward")
    if not table:
        return None
    points = sorted(table)
    if kv_length <= points[0][0]:  # below the first point: scale down linearly
        return points[0][1] * kv_length / points[0][0]
    for (l0, r0), (l1, r1) in zip(points, points[1:]):
        if kv_length <= l1:
            w = (math.log2(kv_length) - math.log2(l0)) / (math.log2(l1) - math.log2(l0))
            return r0 + w * (r1 - r0)
    return points[-1][1]
