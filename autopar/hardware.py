"""Hardware profiles: compute peaks, memory, and the links between devices, as plain data.

Figures are per device. A link is (alpha, bandwidth): a collective over it costs
alpha + factor x bytes / bandwidth (see autopar.solver.cost), where bandwidth is the bus
bandwidth a collective achieves per device in one direction (NCCL's "busbw") and beta =
1 / bandwidth. Every built-in profile is one entry of `BUILTIN` (plain numbers), turned into a
`HardwareProfile` by `HardwareProfile.from_dict`; a calibrated profile (autopar.calibrate) is
the same data, measured, and round-trips through JSON (`save` / `load`).

Sources of the built-in figures (vendor datasheets; dense, i.e. without 2:4 sparsity):
- A100-SXM4-80GB (NVIDIA A100 datasheet, Ampere whitepaper): FP32 19.5 TFLOP/s, TF32 156,
  BF16/FP16 312; 80 GB HBM2e at 2,039 GB/s; NVLink3 600 GB/s bidirectional per GPU (300 GB/s
  each way). DGX A100: 8 GPUs per node, 8x ConnectX-6 HDR 200 Gb/s (25 GB/s per GPU).
- H100-SXM5-80GB (NVIDIA H100 datasheet): FP32 67 TFLOP/s, TF32 494.7, BF16/FP16 989.4;
  80 GB HBM3 at 3.35 TB/s; NVLink4 900 GB/s bidirectional per GPU (450 GB/s each way).
  DGX H100: 8 GPUs per node, 8x ConnectX-7 NDR 400 Gb/s (50 GB/s per GPU).
- H200-SXM-141GB (NVIDIA H200 datasheet): the H100's compute; 141 GB HBM3e at 4.8 TB/s; the
  same NVLink4 and NDR links (DGX H200).
- Per-op efficiency (autopar.solver.efficiency). The best share of peak a bf16 GEMM reaches,
  the "maximum achievable matmul FLOPS" (MAMF) of the comparison table in Stas Bekman's
  ml-engineering book (compute/accelerator/README.md, measured with its mamf-finder.py):
  H100 SXM 792.1 of 989 TFLOP/s (80.1%) at M x N x K = 6144 x 17920 x 2816, A100 SXM 267.9
  of 312 (85.9%) at 6912 x 16384 x 2048, both CUDA 12.1. SM counts from the datasheets (H100
  SXM5: 132, A100: 108). The output tiles are CUTLASS's and cuBLAS's common bf16 tiles on
  these parts: 128 x 256 either way, and 128 x 128 down to 64 x 64 for outputs too small to
  fill the SMs with large ones (their somewhat lower per-SM rate is not modelled); a tile's
  pipeline fill is taken as four 64-wide K blocks (256 elements). On the H100 and H200 the
  analytic share is corrected by GEMM shares measured on each GPU with PyTorch 2.11
  (autopar.measured.GEMM_H100 and GEMM_H200, 72 and 71 shapes; the large ones reach
  0.66-0.83 of peak, a 128-wide output 0.3-0.5). Fused attention on the H100 and H200:
  PyTorch 2.11's default SDPA kernel (cuDNN's), measured on each (autopar.measured.SDPA_H100:
  causal forward 378 / 542 / 609 TFLOP/s at 1k / 4k / 16k tokens, backward 277 / 457 / 490;
  SDPA_H200 0-15% faster). `autopar.measured.FLASH_H100` keeps SDPA's flash backend
  (FlashAttention-2, what PyTorch ran on Hopper GPUs through 2024) measured on the H100, for
  profiles of older PyTorch. The A100 has no attention table here: its attention is priced
  as a GEMM at the MAMF share. Elementwise kernels reach about 90% of the HBM datasheet
  bandwidth (STREAM-style copy benchmarks on A100 and H100; measured here: an H100 copy 2.97
  of 3.35 TB/s, an H200's 4.2 of 4.8); on the H100 and H200 a cast to a wider float type
  reaches 0.51 of that and a kernel reading a broadcast operand 0.67 (PyTorch 2.11's kernels,
  measured on an H200, autopar.measured.COPY_H200; inside an H100's step the same kernels
  run at 0.59-0.76 and 0.67).
- Overlap: on GPUs collectives run on their own CUDA streams beside compute (NCCL), so the
  ones the runtime issues ahead of need (FSDP gathers, gradient buckets) hide under compute;
  a gloo rank on a small CPU machine has no spare core for them (`overlap` False).
Memory sizes are what the device reports (nvidia-smi: 81920 MiB for A100-80GB, 81559 MiB for
H100-80GB, 143771 MiB for H200). Link bandwidths are the vendor's per-direction peak times the
share collectives reach in practice (NVIDIA's p2p test reaches about 380 of NVLink4's 450 GB/s
each way, NCCL all-reduce bus bandwidth about 80% of the link; InfiniBand about 92% of the
line rate); the latencies (alpha) are typical NCCL small-message latencies (ring, one node or
a few nodes). Replace them with measured ones with autopar.calibrate.

The CPU profile is one rank of a gloo world on a small CPU machine, a conservative default for
tests: autopar.calibrate measures the machine it runs on.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

import torch

from . import measured

GB = 1e9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Link:
    """One kind of interconnect: latency per collective (s) and bus bandwidth (bytes/s).

    `per_kind` holds measured (kind, alpha, bandwidth) of collectives whose implementation
    departs from the ring model (gloo's reduce-scatter, for one); other kinds use the link's
    own figures.
    """

    name: str
    alpha: float
    bandwidth: float
    per_kind: tuple[tuple[str, float, float], ...] = ()

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / self.bandwidth

    def for_kind(self, kind: str) -> tuple[float, float]:
        """(alpha, bandwidth) of collectives of `kind` over this link."""
        for k, alpha, bandwidth in self.per_kind:
            if k == kind:
                return alpha, bandwidth
        return self.alpha, self.bandwidth

    @staticmethod
    def from_dict(d: dict) -> Link:
        """Inverse of dataclasses.asdict (JSON turns tuples into lists)."""
        d = dict(d)
        d["per_kind"] = tuple(tuple(x) for x in d.get("per_kind", ()))
        return Link(**d)


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute and memory, and the links inside and between nodes."""

    name: str
    flops: dict[str, float]          # peak dense flop/s by dtype name ("float32", "bfloat16")
    memory_bandwidth: float          # bytes/s
    memory: float                    # bytes of device memory
    launch: float                    # seconds of fixed overhead per op (kernel launch)
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    memory_reserve: float = 0.1      # share of memory kept free for the allocator and workspace
    view_launch: float = 0.0         # seconds of host overhead per view op (no kernel runs; it
    #                                  matters where the host does not run ahead, as on CPUs)
    # Per-op efficiency (autopar.solver.efficiency); the defaults price the plain roofline.
    matmul_efficiency: float = 1.0   # the best share of bf16 peak a GEMM reaches (MAMF / peak)
    matmul_best_shape: tuple[int, int, int] = (0, 0, 0)  # (M, N, K) where it was reached
    sm_count: int = 0                # SMs a GEMM's tiles are spread over (0: no quantization)
    gemm_tiles: tuple[tuple[int, int], ...] = ((128, 256),)  # output tiles cuBLAS picks among
    gemm_k_overhead: float = 0.0     # pipeline fill per tile, in inner (K) elements
    gemm_measured: tuple[tuple[int, int, int, float], ...] = ()  # (M, N, K, share) measured
    attention: dict = field(default_factory=dict)  # fused SDPA flop/s by kv length, per pass
    memory_efficiency: float = 1.0   # share of memory bandwidth elementwise kernels reach
    widening_efficiency: float = 1.0  # share of that a cast to a wider float type reaches
    broadcast_efficiency: float = 1.0  # share of that a kernel reading a broadcast operand reaches
    overlap: bool = False            # collectives run beside compute (their own stream)
    measured: dict = field(default_factory=dict, compare=False)  # calibration details

    def __post_init__(self):
        problems = []
        if not isinstance(self.flops, dict) or not _positive(self.flops.get("float32")):
            problems.append("flops needs a positive 'float32' peak (flop/s; the figure for "
                            "any dtype without its own), e.g. {'float32': 67e12, "
                            "'bfloat16': 989e12}")
        elif not all(_positive(v) for v in self.flops.values()):
            problems.append(f"every flops figure must be positive flop/s, not {self.flops}")
        for name in ("memory_bandwidth", "memory"):
            if not _positive(getattr(self, name)):
                problems.append(f"{name} must be positive (bytes{'/s' if 'band' in name else ''}"
                                f"), not {getattr(self, name)!r}")
        for name in ("intra_node", "inter_node"):
            link = getattr(self, name)
            if not isinstance(link, Link):
                problems.append(f"{name} must be an autopar.Link(name, alpha, bandwidth), not "
                                f"{type(link).__name__} (HardwareProfile.from_dict reads a dict)")
            elif not _positive(link.bandwidth) or not isinstance(link.alpha, numbers.Real) \
                    or link.alpha < 0:
                problems.append(f"{name} needs a positive bandwidth (bytes/s) and a latency "
                                f"alpha >= 0 (s), not {link}")
        if not positive_integer(self.devices_per_node):
            problems.append(f"devices_per_node must be a positive integer, not "
                            f"{self.devices_per_node!r}")
        if not 0 <= self.memory_reserve < 1:
            problems.append(f"memory_reserve is a share of memory in [0, 1), not "
                            f"{self.memory_reserve!r}")
        if problems:
            raise ValueError(f"hardware profile {self.name!r}: " + "; ".join(problems))

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak flop/s for `dtype` (float32 figures for anything without its own)."""
        return self.flops.get(str(dtype).removeprefix("torch."), self.flops["float32"])

    @property
    def memory_budget(self) -> float:
        """Bytes per device a plan may use by default: memory less the reserve."""
        return self.memory * (1 - self.memory_reserve)

    def with_links(self, intra: Link | None = None, inter: Link | None = None) -> HardwareProfile:
        """A copy with measured links (see autopar.calibrate)."""
        return replace(self, intra_node=intra or self.intra_node,
                       inter_node=inter or self.inter_node)

    def to_dict(self) -> dict:
        """Plain data for JSON (calibration details included)."""
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> HardwareProfile:
        """Inverse of to_dict; a missing field is an error naming it."""
        d = dict(d)
        required = [f.name for f in fields(HardwareProfile)
                    if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"hardware profile {d.get('name', '?')!r} lacks "
                             f"{', '.join(missing)}; a profile needs {', '.join(required)} "
                             "(see autopar.hardware.BUILTIN for examples)")
        d["intra_node"] = Link.from_dict(d["intra_node"])
        d["inter_node"] = Link.from_dict(d["inter_node"])
        d["flops"] = dict(d["flops"])
        if "matmul_best_shape" in d:
            d["matmul_best_shape"] = tuple(d["matmul_best_shape"])
        if "gemm_measured" in d:
            d["gemm_measured"] = tuple(tuple(t) for t in d["gemm_measured"])
        if "gemm_tiles" in d:
            d["gemm_tiles"] = tuple(tuple(t) for t in d["gemm_tiles"])
        d["attention"] = {k: tuple(tuple(p) for p in v)
                          for k, v in (d.get("attention") or {}).items()}
        d["measured"] = dict(d.get("measured") or {})
        return HardwareProfile(**d)

    def save(self, path: str) -> None:
        """Write the profile as JSON (e.g. a calibrated one, to plan with later)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @staticmethod
    def load(path: str) -> HardwareProfile:
        """Read a profile written by `save`."""
        with open(path) as f:
            return HardwareProfile.from_dict(json.load(f))


def _positive(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x > 0


def positive_integer(x) -> bool:
    """Whether `x` is an integer (Python's or numpy's) of at least 1: a count of devices."""
    return isinstance(x, numbers.Integral) and x >= 1


GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64), (64, 64))

# The built-in profiles, as data (sources in the module docstring).
BUILTIN: dict[str, dict] = {
    "a100": {
        "name": "a100",
        "flops": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        "memory_bandwidth": 2.039e12, "memory": 81920 * MiB, "launch": 5e-6,
        "intra_node": {"name": "nvlink3", "alpha": 10e-6, "bandwidth": 0.8 * 300 * GB},
        "inter_node": {"name": "ib-hdr", "alpha": 20e-6, "bandwidth": 0.92 * 25 * GB},
        "devices_per_node": 8,
        "matmul_efficiency": 267.9 / 312, "matmul_best_shape": (6912, 16384, 2048),
        "sm_count": 108, "gemm_tiles": GEMM_TILES, "gemm_k_overhead": 256,
        "memory_efficiency": 0.9, "overlap": True,
    },
    "h100": {
        "name": "h100",
        "flops": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12,
                  "float16": 989.4e12},
        "memory_bandwidth": 3.35e12, "memory": 81559 * MiB, "launch": 4e-6,
        "intra_node": {"name": "nvlink4", "alpha": 8e-6, "bandwidth": 0.8 * 450 * GB},
        "inter_node": {"name": "ib-ndr", "alpha": 18e-6, "bandwidth": 0.92 * 50 * GB},
        "devices_per_node": 8,
        "matmul_efficiency": 792.1 / 989.4, "matmul_best_shape": (6144, 17920, 2816),
        "sm_count": 132, "gemm_tiles": GEMM_TILES, "gemm_k_overhead": 256,
        "gemm_measured": measured.GEMM_H100,
        "attention": measured.SDPA_H100,
        "memory_efficiency": 0.9, "widening_efficiency": round(measured.WIDENING_H200, 3),
        "broadcast_efficiency": round(measured.BROADCAST_H200, 3), "overlap": True,
    },
    "cpu": {
        "name": "cpu",
        "flops": {"float32": 20e9, "bfloat16": 5e9},
        "memory_bandwidth": 5 * GB, "memory": 24 * GiB, "launch": 15e-6, "view_launch": 3e-6,
        "intra_node": {"name": "gloo-loopback", "alpha": 150e-6, "bandwidth": 1.0 * GB},
        "inter_node": {"name": "gloo-tcp", "alpha": 300e-6, "bandwidth": 0.5 * GB},
        "devices_per_node": 64,
    },
}

# The H200 is an H100 with more and faster memory (same compute, NVLink4 and NDR links), and
# its own measured op rates.
BUILTIN["h200"] = {**BUILTIN["h100"], "name": "h200", "memory_bandwidth": 4.8e12,
                   "memory": 143771 * MiB, "gemm_measured": measured.GEMM_H200,
                   "attention": measured.SDPA_H200}

PROFILES: dict[str, HardwareProfile] = {k: HardwareProfile.from_dict(v)
                                        for k, v in BUILTIN.items()}
A100, H100, H200, CPU = (PROFILES[k] for k in ("a100", "h100", "h200", "cpu"))


def get_profile(hardware: str | HardwareProfile | dict) -> HardwareProfile:
    """A built-in profile by name, the given profile, or one read from a dict (the fields of
    HardwareProfile, as `to_dict` writes them)."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, dict):
        return HardwareProfile.from_dict(hardware)
    if not isinstance(hardware, str):
        raise TypeError(f"hardware must be a built-in profile's name "
                        f"({', '.join(sorted(PROFILES))}), an autopar.HardwareProfile or a dict "
                        f"of its fields, not {type(hardware).__name__}")
    try:
        return PROFILES[hardware.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {hardware!r}; built-in profiles: "
                         f"{', '.join(sorted(PROFILES))}, or pass a HardwareProfile") from None
