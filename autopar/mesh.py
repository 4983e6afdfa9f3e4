"""MeshSpec: the shape of a device mesh and the hardware behind it, with no processes needed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .hardware import HardwareProfile, Link, get_profile


@dataclass(frozen=True)
class MeshSpec:
    """A mesh of devices for planning: shape, dimension names and hardware profile.

    Devices are numbered row-major over the mesh, and consecutive devices share a node
    (`devices_per_node`, default from the hardware profile). A mesh dimension whose groups stay
    inside one node uses the intra-node link; otherwise the inter-node link.
    """

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None
    hardware: str | HardwareProfile = "h100"
    devices_per_node: int | None = None
    profile: HardwareProfile = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape must be positive sizes, got {self.shape}")
        names = tuple(self.names) if self.names is not None else tuple(
            f"d{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"{len(names)} names for a {len(shape)}-D mesh")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "profile", get_profile(self.hardware))
        if not isinstance(self.hardware, str):
            object.__setattr__(self, "hardware", self.profile.name)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def link(self, dim: int) -> Link:
        """The link a collective over mesh dimension `dim` runs on."""
        per_node = self.devices_per_node or self.profile.devices_per_node
        stride = math.prod(self.shape[dim + 1:])
        span = stride * self.shape[dim]  # consecutive device ids one group covers
        return self.profile.intra_node if span <= per_node else self.profile.inter_node

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return {"shape": list(self.shape), "names": list(self.names),
                "hardware": self.profile.to_dict(), "devices_per_node": self.devices_per_node}

    @staticmethod
    def from_dict(d: dict) -> MeshSpec:
        """Inverse of to_dict."""
        hw = d["hardware"]
        hw = HardwareProfile.from_dict(hw) if isinstance(hw, dict) else hw
        return MeshSpec(tuple(d["shape"]), tuple(d["names"]), hw, d.get("devices_per_node"))

    @staticmethod
    def from_device_mesh(mesh, hardware: str | HardwareProfile | None = None) -> MeshSpec:
        """The spec of a torch DeviceMesh (hardware defaults to cpu for gloo, h100 otherwise)."""
        if hardware is None:
            hardware = "cpu" if mesh.device_type == "cpu" else "h100"
        names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
        return MeshSpec(tuple(mesh.shape), tuple(names), hardware)
