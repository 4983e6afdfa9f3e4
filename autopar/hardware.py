"""Hardware profiles: compute peaks, memory, and the links between devices, as plain data.

Figures are per device. Link bandwidth is the bus bandwidth a collective sees per device in one
direction (NCCL's "busbw"), so a ring all-reduce of B bytes on n devices takes about
alpha + 2 (n - 1) / n * B / bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Link:
    """One kind of interconnect: latency per collective (s) and bandwidth (bytes/s)."""

    name: str
    alpha: float
    bandwidth: float


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute and memory, and the links inside and between nodes."""

    name: str
    flops: dict[str, float]          # peak dense flop/s by dtype name ("float32", "bfloat16")
    memory_bandwidth: float          # bytes/s
    memory: float                    # bytes of device memory
    launch: float                    # seconds of fixed overhead per op
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    memory_reserve: float = 0.1      # share of memory kept free for the allocator and workspace
    measured: dict = field(default_factory=dict, compare=False)  # op timings, by key

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak flop/s for `dtype` (float32 figures for anything without its own)."""
        return self.flops.get(str(dtype).removeprefix("torch."), self.flops["float32"])

    def with_links(self, intra: Link | None = None, inter: Link | None = None) -> HardwareProfile:
        """A copy with measured links (see autopar.calibrate)."""
        return replace(self, intra_node=intra or self.intra_node,
                       inter_node=inter or self.inter_node)

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        d = asdict(self)
        d.pop("measured")
        return d

    @staticmethod
    def from_dict(d: dict) -> HardwareProfile:
        """Inverse of to_dict."""
        d = dict(d)
        d["intra_node"] = Link(**d["intra_node"])
        d["inter_node"] = Link(**d["inter_node"])
        return HardwareProfile(**d)


# DGX A100: A100-SXM4-80GB, NVLink3 600 GB/s bidirectional per GPU, 8x HDR 200 Gb/s per node.
A100 = HardwareProfile(
    "a100", {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    2.04e12, 80 * GiB, 5e-6, Link("nvlink3", 10e-6, 240 * GB), Link("ib-hdr", 20e-6, 23 * GB), 8)
# DGX H100: H100-SXM5-80GB, NVLink4 900 GB/s bidirectional per GPU, 8x NDR 400 Gb/s per node.
H100 = HardwareProfile(
    "h100", {"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12},
    3.35e12, 80 * GiB, 4e-6, Link("nvlink4", 8e-6, 370 * GB), Link("ib-ndr", 18e-6, 46 * GB), 8)
# DGX H200: the H100's compute with 141 GB of HBM3e at 4.8 TB/s; same links.
H200 = replace(H100, name="h200", memory_bandwidth=4.8e12, memory=141 * GB)
# One rank of a gloo world on a small CPU machine (2 cores shared by the ranks): a conservative
# default; autopar.calibrate measures the real links.
CPU = HardwareProfile(
    "cpu", {"float32": 20e9, "bfloat16": 5e9}, 5 * GB, 24 * GiB, 15e-6,
    Link("gloo-loopback", 150e-6, 1.0 * GB), Link("gloo-tcp", 300e-6, 0.5 * GB), 64)

PROFILES = {p.name: p for p in (A100, H100, H200, CPU)}


def get_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """A built-in profile by name, or the given profile."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    try:
        return PROFILES[hardware.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {hardware!r}; built-in profiles: "
                         f"{', '.join(sorted(PROFILES))}, or pass a HardwareProfile") from None
