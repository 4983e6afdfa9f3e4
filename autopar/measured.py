"""Op rates measured on a GPU by `python -m benchmarks.gpu_check` (benchmarks/RESULTS.md, "One
GPU"), kept as data the built-in profiles use (autopar.hardware).

Measured 2026-11-26 on one NVIDIA H200 SXM (132 SMs; the H100 SXM's compute, so its matrix and
attention rates stand for the H100's too), PyTorch 2.11.0 with CUDA 13.0, bf16:

- `GEMM_H200`: (M, N, K, share of the 989.4 TFLOP/s dense bf16 peak) of `a @ b`, a (M x K)
  and b (K x N) random, each shape timed back to back for 20 ms, three rounds, twice in
  shuffled orders, the faster kept. Only shapes whose product takes at least 40 us are kept:
  below that a call costs the host's ~10 us launch whatever its size. solver/efficiency.py
  scales its analytic share (tile, wave and K-pipeline quantization) by the measured /
  analytic ratio of the nearest measured shapes.
- `SDPA_H200`: causal `scaled_dot_product_attention`, head dimension 128, 32 heads, 16,384
  tokens per call, flop/s by sequence length in the FlashAttention papers' count (causal
  forward 4 b h s^2 d / 2, backward 2.5x that). PyTorch 2.11 runs cuDNN's attention on this
  GPU by default (the same rates as forcing SDPBackend.CUDNN_ATTENTION; the flash backend,
  FlashAttention-2, reached 290 / 296 TFLOP/s forward / backward at 8,192 tokens). No
  non-causal rate was measured: the table's "forward" repeats the causal one (a full mask
  reaches at least the causal rate per flop).
- `COPY_H200`: GB/s (bytes read + written) of memory-bound kernels over 2^28 elements, the
  faster of two medians of 10 (gpu_check's "timeline", session 16): a copy, a cast each way
  and a product with a broadcast operand. A cast to a wider float type reaches about half of
  a copy's bandwidth (PyTorch's cast kernel does not vectorize it; the narrowing cast does),
  a product reading a broadcast operand two thirds (its loads are not vectorized either,
  contiguous or strided). The H100 runs the same kernels: `widening_efficiency` and
  `broadcast_efficiency` of its profile are these ratios.
"""

from __future__ import annotations

GEMM_H200 = (
    (256, 4096, 16384, 0.621), (256, 16384, 4096, 0.716), (256, 16384, 16384, 0.758),
    (1024, 1024, 16384, 0.662), (1024, 4096, 4096, 0.7), (1024, 4096, 16384, 0.825),
    (1024, 16384, 1024, 0.665), (1024, 16384, 4096, 0.789), (1024, 16384, 16384, 0.77),
    (3584, 8192, 131072, 0.785), (4096, 128, 16384, 0.409), (4096, 256, 16384, 0.59),
    (4096, 1024, 4096, 0.66), (4096, 1024, 16384, 0.818), (4096, 4096, 1024, 0.653),
    (4096, 4096, 4096, 0.774), (4096, 4096, 16384, 0.831), (4096, 16384, 128, 0.352),
    (4096, 16384, 256, 0.51), (4096, 16384, 1024, 0.69), (4096, 16384, 4096, 0.751),
    (4096, 16384, 16384, 0.691), (6144, 17920, 2816, 0.771), (8192, 8192, 8192, 0.797),
    (14336, 4096, 16384, 0.835), (16384, 128, 16384, 0.535), (16384, 256, 4096, 0.622),
    (16384, 256, 16384, 0.765), (16384, 512, 4096, 0.757), (16384, 1024, 1024, 0.68),
    (16384, 1024, 4096, 0.767), (16384, 1024, 16384, 0.823), (16384, 4096, 128, 0.354),
    (16384, 4096, 256, 0.506), (16384, 4096, 1024, 0.732), (16384, 4096, 4096, 0.77),
    (16384, 4096, 14336, 0.817), (16384, 4096, 16384, 0.771), (16384, 14336, 4096, 0.813),
    (16384, 16384, 128, 0.375), (16384, 16384, 256, 0.473), (16384, 16384, 1024, 0.679),
    (16384, 16384, 4096, 0.744), (16384, 16384, 16384, 0.704), (16384, 128256, 4096, 0.694),
    (65536, 128, 1024, 0.394), (65536, 128, 4096, 0.501), (65536, 128, 16384, 0.537),
    (65536, 256, 1024, 0.595), (65536, 256, 4096, 0.745), (65536, 256, 16384, 0.77),
    (65536, 1024, 128, 0.365), (65536, 1024, 256, 0.534), (65536, 1024, 1024, 0.641),
    (65536, 1024, 4096, 0.758), (65536, 1024, 16384, 0.709), (65536, 4096, 128, 0.388),
    (65536, 4096, 256, 0.547), (65536, 4096, 1024, 0.693), (65536, 4096, 4096, 0.778),
    (65536, 4096, 16384, 0.759), (65536, 16384, 128, 0.356), (65536, 16384, 256, 0.495),
    (65536, 16384, 1024, 0.749), (65536, 16384, 4096, 0.749), (65536, 16384, 16384, 0.702),
    (128256, 4096, 16384, 0.711), (131072, 128, 8192, 0.535), (131072, 1024, 8192, 0.817),
    (131072, 3584, 8192, 0.72), (131072, 8192, 3584, 0.712),
)

_CAUSAL_FORWARD = ((1024, 435e12), (2048, 525e12), (4096, 587e12), (8192, 574e12),
                   (16384, 626e12))
SDPA_H200 = {
    "forward": _CAUSAL_FORWARD,
    "forward_causal": _CAUSAL_FORWARD,
    "backward": ((1024, 319e12), (2048, 426e12), (4096, 459e12), (8192, 485e12),
                 (16384, 508e12)),
}

COPY_H200 = {
    "copy bf16": 3957, "copy fp32": 4103, "cast bf16 -> fp32": 2076, "cast fp32 -> bf16": 4201,
    "mul strided half x broadcast (fp32)": 2706, "mul contiguous x broadcast (fp32)": 2733,
}
# Shares of a same-dtype copy's bandwidth (the profile's memory_efficiency prices the copy).
WIDENING_H200 = COPY_H200["cast bf16 -> fp32"] / COPY_H200["copy fp32"]
BROADCAST_H200 = COPY_H200["mul contiguous x broadcast (fp32)"] / COPY_H200["copy fp32"]
