"""MeshSpec: the shape of a device mesh and the hardware behind it, with no processes needed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .hardware import HardwareProfile, Link, get_profile, positive_integer


@dataclass(frozen=True)
class MeshSpec:
    """A mesh of devices for planning: shape, dimension names and hardware profile.

    Devices are numbered row-major over the mesh, and consecutive devices share a node
    (`devices_per_node`, default from the hardware profile). A mesh dimension whose groups stay
    inside one node uses the intra-node link; otherwise the inter-node link.

    A dimension named "pp" is for pipeline stages: the model is cut by depth into stages along
    it (autopar.solver.stages), and every stage is planned on the other dimensions. Any other
    name is a dimension the intra-op solver shards ops over.
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
        names = _check_names(self.names, shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "profile", get_profile(self.hardware))
        check_devices_per_node(self.devices_per_node, self.profile)
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

    @property
    def pipeline_dim(self) -> int | None:
        """Index of the "pp" dimension when it splits the mesh (size > 1), else None."""
        if "pp" in self.names and self.shape[self.names.index("pp")] > 1:
            return self.names.index("pp")
        return None

    def without(self, dim: int) -> MeshSpec:
        """The mesh of the other dimensions (what one pipeline stage runs on); each keeps the
        link it has in this mesh."""
        keep = tuple(k for k in range(self.ndim) if k != dim)
        return Submesh(tuple(self.shape[k] for k in keep) or (1,),
                       tuple(self.names[k] for k in keep) or ("d0",), self.profile,
                       self.devices_per_node, parent=self, dims=keep)

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


def _check_names(names, shape: tuple[int, ...]) -> tuple[str, ...]:
    """One distinct string per mesh dimension (d0, d1, ... when not given)."""
    if names is None:
        return tuple(f"d{i}" for i in range(len(shape)))
    names = (names,) if isinstance(names, str) else tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} mesh dimension names {names} for a {len(shape)}-D mesh "
                         f"of shape {shape}: give one name per dimension")
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"mesh dimension names must be strings, got {names}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"mesh dimension name {repeated[0]!r} is used for more than one "
                         f"dimension of the mesh {names}: each dimension needs its own name "
                         "(e.g. ('dp', 'tp')), since force= and plans refer to dimensions "
                         "by name")
    return names


@dataclass(frozen=True)
class Submesh(MeshSpec):
    """Some dimensions of a `parent` mesh (`dims`), with the parent's links."""

    parent: MeshSpec | None = None
    dims: tuple[int, ...] = ()

    def link(self, dim: int) -> Link:
        if self.parent is None or not self.dims:
            return super().link(dim)
        return self.parent.link(self.dims[dim])


def check_devices_per_node(per_node, profile: HardwareProfile) -> None:
    """Raises ValueError unless `per_node` is None (the hardware profile's count) or a positive
    integer."""
    if per_node is not None and not positive_integer(per_node):
        raise ValueError(f"devices_per_node must be a positive integer (or None: the "
                         f"hardware's, {profile.devices_per_node}), not {per_node!r}")
