"""Op rates measured on a GPU by `python -m benchmarks.gpu_check` (benchmarks/RESULTS.md, "One
GPU"), kept as data the built-in profiles use (autopar.hardware).

Measured 2026-11-26 on one NVIDIA H200 SXM (132 SMs; the H100 SXM's compute), PyTorch 2.11.0
with CUDA 13.0, bf16 (the H100's own tables, measured the same way, are at the end):

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
  contiguous or strided). `widening_efficiency` and `broadcast_efficiency` of the H100 and
  H200 profiles are these ratios: on an H100 (session 20) the rotary embedding's broadcast
  products inside a step run at 2.0 TB/s, 0.67 of the profile's copy rate (0.9 x 3.35
  TB/s), and its widening casts at 0.59-0.76 of it.
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

# -- H100 -----------------------------------------------------------------------------------------
# Measured 2026-11-26 (session 20) on one NVIDIA H100 80GB HBM3 (SXM, 132 SMs; a bf16 8192^3
# product 778 TFLOP/s, a 2^30-element copy 2,971 GB/s), PyTorch 2.11.0 with CUDA 13.0, by the
# same parts of gpu_check as the H200's tables above (`gemm` and `sweep`, `attention`,
# `kernels`). The large products reach 0.66-0.81 of peak: a median 0.97 of the H200's share
# of the same shape (71 shapes in both tables; the same chip, with slower memory). Attention
# (the default backend, cuDNN's) reaches 0.85-1.0 of the H200's rates forward and 0.87-1.0
# backward, the least at short sequences.
GEMM_H100 = (
    (256, 4096, 16384, 0.557), (256, 16384, 4096, 0.636), (256, 16384, 16384, 0.689),
    (1024, 1024, 16384, 0.616), (1024, 4096, 4096, 0.699), (1024, 4096, 16384, 0.802),
    (1024, 16384, 1024, 0.64), (1024, 16384, 4096, 0.767), (1024, 16384, 16384, 0.718),
    (3584, 8192, 131072, 0.725), (4096, 128, 16384, 0.278), (4096, 256, 16384, 0.526),
    (4096, 1024, 4096, 0.726), (4096, 1024, 16384, 0.795), (4096, 4096, 1024, 0.646),
    (4096, 4096, 4096, 0.758), (4096, 4096, 16384, 0.809), (4096, 16384, 128, 0.29),
    (4096, 16384, 256, 0.507), (4096, 16384, 1024, 0.722), (4096, 16384, 4096, 0.765),
    (4096, 16384, 16384, 0.716), (6144, 17920, 2816, 0.749), (8192, 8192, 8192, 0.778),
    (14336, 4096, 16384, 0.802), (16384, 128, 4096, 0.322), (16384, 128, 16384, 0.359),
    (16384, 256, 4096, 0.557), (16384, 256, 16384, 0.67), (16384, 512, 4096, 0.75),
    (16384, 1024, 1024, 0.665), (16384, 1024, 4096, 0.77), (16384, 1024, 16384, 0.798),
    (16384, 4096, 128, 0.289), (16384, 4096, 256, 0.478), (16384, 4096, 1024, 0.696),
    (16384, 4096, 4096, 0.771), (16384, 4096, 14336, 0.771), (16384, 4096, 16384, 0.784),
    (16384, 14336, 4096, 0.761), (16384, 16384, 128, 0.307), (16384, 16384, 256, 0.489),
    (16384, 16384, 1024, 0.658), (16384, 16384, 4096, 0.718), (16384, 16384, 16384, 0.696),
    (16384, 128256, 4096, 0.722), (65536, 128, 1024, 0.286), (65536, 128, 4096, 0.341),
    (65536, 128, 16384, 0.359), (65536, 256, 1024, 0.522), (65536, 256, 4096, 0.628),
    (65536, 256, 16384, 0.686), (65536, 1024, 128, 0.283), (65536, 1024, 256, 0.483),
    (65536, 1024, 1024, 0.633), (65536, 1024, 4096, 0.783), (65536, 1024, 16384, 0.696),
    (65536, 4096, 128, 0.308), (65536, 4096, 256, 0.542), (65536, 4096, 1024, 0.715),
    (65536, 4096, 4096, 0.747), (65536, 4096, 16384, 0.763), (65536, 16384, 128, 0.309),
    (65536, 16384, 256, 0.423), (65536, 16384, 1024, 0.687), (65536, 16384, 4096, 0.77),
    (65536, 16384, 16384, 0.727), (128256, 4096, 16384, 0.687), (131072, 128, 8192, 0.352),
    (131072, 1024, 8192, 0.813), (131072, 3584, 8192, 0.747), (131072, 8192, 3584, 0.725),
)

_CAUSAL_FORWARD_H100 = ((1024, 378e12), (2048, 446e12), (4096, 542e12), (8192, 572e12),
                        (16384, 609e12))
SDPA_H100 = {
    "forward": _CAUSAL_FORWARD_H100,
    "forward_causal": _CAUSAL_FORWARD_H100,
    "backward": ((1024, 277e12), (2048, 379e12), (4096, 457e12), (8192, 464e12),
                 (16384, 490e12)),
}

# SDPA's flash backend (FlashAttention-2, what PyTorch ran on Hopper GPUs through 2024) on the
# same H100, causal, head dimension 128, 16,384 tokens per call (gpu_check's `kernels`):
# 0.80-0.86 forward and 0.63-0.93 backward of the FlashAttention-3 paper's published
# FlashAttention-2 rates (its figures 5 and 6: causal forward 260 / 319 / 333 TFLOP/s at 1k /
# 4k / 8k tokens, backward 260 / 310 / 318), which the torchtitan comparison priced before.
_FLASH_FORWARD_H100 = ((1024, 208e12), (4096, 267e12), (8192, 285e12))
FLASH_H100 = {
    "forward": _FLASH_FORWARD_H100,
    "forward_causal": _FLASH_FORWARD_H100,
    "backward": ((1024, 165e12), (4096, 254e12), (8192, 296e12)),
}
