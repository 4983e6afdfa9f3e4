"""ParameterStore: this rank's parameter shards, as the user's optimizer sees them and as the
local programs consume them.

Every parameter is one `nn.Parameter` holding a DTensor over the device mesh with the plan's
storage placements (as FSDP2 hands them out), registered under the model's own names in a
skeleton of the model's module tree. So `named_parameters()` speaks the model's names,
`torch.nn.utils.clip_grad_norm_` and any other reduction over parameters compute global
values, and `state_dict()` holds sharded tensors that `torch.distributed.checkpoint` saves.

The local programs run on plain tensors: each parameter has a *leaf*, a plain tensor sharing the
DTensor's local storage, which the programs take as input and on which autograd accumulates
gradients and gradient synchronization reduces them. An optimizer stepping the DTensor updates
the leaf in place (same storage). `pull_grads` before a step gives the leaves the gradients the
user left on the DTensors (None after `zero_grad()`), `push_grads` after it hands the leaves'
gradients back as DTensors with the parameters' placements.

A ZeRO parameter (passes/zero.py, runtime/zero.py) has a leaf holding the whole of its stored
block, and the DTensor the user's optimizer steps is a shard of it: a view of this rank's slice
of the leaf. Its gradient reaches the shard by reduce-scatter (`zero` entries, which
`runtime.zero.ZeroSync` fills), and `refresh` gathers stepped shards back into the leaves.

A store over no mesh (a pipeline stage whose only mesh dimension is "pp") keeps plain
parameters, which are their own leaves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.passes.graph_queries import gradient_hook_message
from autopar.passes.placement import Placements, local_slices
from autopar.passes.reshard import BUCKET_BYTES
from autopar.passes.zero import ZeroShard

from .zero import ZeroParam, at_offset_zero, gather_stepped, shard_view


def skeleton_child(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module that holds `path` ("h.0.attn.weight") in `root`'s tree, created empty as
    needed, and the last name."""
    *mods, last = path.split(".")
    m = root
    for name in mods:
        child = dict(m.named_children()).get(name)
        if child is None:
            child = nn.Module()
            m.add_module(name, child)
        m = child
    return m, last


def local_block(full: torch.Tensor, storage: Placements, mesh_shape, coords) -> torch.Tensor:
    """A copy of this rank's block (at mesh `coords`) of `full` stored at `storage`."""
    block = full.detach()
    for d, (start, length) in enumerate(local_slices(full.shape, storage, mesh_shape, coords)):
        block = block.narrow(d, start, length)
    return block.clone()


class ParameterStore:
    """This rank's parameters: DTensor parameters by model name, and their plain leaves."""

    def __init__(self, mesh, placements: dict[str, Placements],
                 local: dict[str, torch.Tensor], requires_grad: dict[str, bool],
                 aliases: dict[str, list[str]],
                 zero: dict[str, tuple[int, ZeroShard]] | None = None,
                 bucket_bytes: float = BUCKET_BYTES):
        """`mesh` is the DeviceMesh the placements are over (None: plain parameters);
        `local[name]` this rank's block of each parameter (taken, not copied); `aliases` the
        other names a tied parameter goes by in the model; `zero` the ZeRO stage and shard of
        the parameters that have one (`bucket_bytes`: how much `refresh` gathers at once)."""
        self.mesh = mesh
        self.placements = dict(placements)
        self.params: dict[str, nn.Parameter] = {}
        self.leaves: dict[str, torch.Tensor] = {}
        self.zero: dict[str, ZeroParam] = {}
        self.bucket_bytes = bucket_bytes
        for name, block in local.items():
            if mesh is None:
                p = nn.Parameter(block, requires_grad=requires_grad[name])
                self.params[name], self.leaves[name] = p, p
                continue
            if zero and name in zero:
                stage, shard = zero[name]
                leaf = nn.Parameter(block, requires_grad=requires_grad[name])
                k = shard.mesh_dim
                view = shard_view(leaf, shard, mesh.get_coordinate()[k], mesh.shape[k])
                self.leaves[name] = leaf
                self.params[name] = nn.Parameter(
                    DTensor.from_local(view, mesh, shard.placements, run_check=False),
                    requires_grad=requires_grad[name])
                self.zero[name] = ZeroParam(stage, shard, view)
                continue
            dt = DTensor.from_local(at_offset_zero(block), mesh, placements[name],
                                    run_check=False)
            p = nn.Parameter(dt, requires_grad=requires_grad[name])
            with torch.no_grad():  # a leaf on the same storage as the DTensor's block
                self.leaves[name] = nn.Parameter(p.to_local(),
                                                 requires_grad=requires_grad[name])
            self.params[name] = p
        self.aliases = {n: list(a) for n, a in aliases.items() if n in self.params}
        if self.zero:  # what `refresh`, run before every program, checks and gathers over
            self._zero_entries = [(self.leaves[n], z) for n, z in self.zero.items()]
            self._groups = [mesh.get_group(k) for k in range(mesh.ndim)]

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def zero_stages(self) -> dict[str, int]:
        """The ZeRO stage of each parameter that has one."""
        return {n: z.stage for n, z in self.zero.items()}

    def user_placements(self, name: str) -> Placements:
        """The placements of the DTensor the user sees for parameter `name` (its ZeRO shard's,
        or where it is stored)."""
        z = self.zero.get(name)
        return z.shard.placements if z is not None else self.placements[name]

    def refresh(self) -> None:
        """Gather the ZeRO shards (what an optimizer steps) into the whole copies the
        programs use (a collective when the plan has ZeRO parameters; call before each step
        or inference call)."""
        if self.zero:
            gather_stepped(self._zero_entries, self._groups, self.bucket_bytes)

    def whole_grad(self, name: str) -> torch.Tensor:
        """The whole gradient of parameter `name`, zeros when it has none (a collective)."""
        z = self.zero.get(name)
        g = self.params[name].grad  # what the user's optimizer sees (None after zero_grad;
        # whatever the loop set after step(): p.grad = p.grad * scale)
        g = g.to_local() if isinstance(g, DTensor) else g
        if z is None:
            return self.whole(name, g if g is not None else torch.zeros_like(self.leaves[name]))
        g = g if g is not None else torch.zeros_like(z.view)
        return DTensor.from_local(g, self.mesh, z.shard.placements, run_check=False).full_tensor()

    def register(self, root: nn.Module) -> None:
        """Register every parameter on `root` under the model's names (tied ones under each
        of their names, as the model had them)."""
        for name, p in self.params.items():
            for path in [name, *self.aliases.get(name, [])]:
                owner, last = skeleton_child(root, path)
                owner.register_parameter(last, p)

    def whole(self, name: str, block: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor of parameter `name`, or of `block` (a tensor stored like it, e.g.
        its gradient): all-gathers over the mesh, a collective."""
        if block is None and name in self.zero:  # the shards are current, the leaf may not be
            return self.params[name].detach().full_tensor()
        x = (self.leaves[name] if block is None else block).detach()
        if not self.distributed:
            return x
        return DTensor.from_local(x, self.mesh, self.placements[name],
                                  run_check=False).full_tensor()

    def compute(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """What a program takes for parameter `name`: its leaf, or under mixed precision the
        leaf (the float32 master) cast to the compute `dtype`, once per program run: each
        microbatch of a step (autograd casts the gradient back: it reaches the leaf in the
        master dtype, where the microbatches' gradients add up)."""
        leaf = self.leaves[name]
        if dtype is None or not leaf.is_floating_point() or leaf.dtype == dtype:
            return leaf
        return leaf.to(dtype)

    def alias_of(self, name: str) -> str | None:
        """The parameter `name` (or one of its tied names) stands for, or None."""
        if name in self.params:
            return name
        return next((p for p, names in self.aliases.items() if name in names), None)

    def load_whole(self, name: str, value: torch.Tensor) -> None:
        """Set parameter `name` from `value`: a whole tensor (this rank keeps its block) or a
        DTensor (redistributed to the parameter's placements)."""
        leaf = self.leaves[name]
        if isinstance(value, DTensor):
            if self.distributed and value.device_mesh == self.mesh:
                with torch.no_grad():
                    leaf.copy_(value.redistribute(self.mesh, self.placements[name]).to_local())
                return
            value = value.full_tensor()
        if self.distributed:
            coords = tuple(self.mesh.get_coordinate())
            value = local_block(value, self.placements[name], tuple(self.mesh.shape), coords)
        with torch.no_grad():
            leaf.copy_(value)

    def pull_grads(self) -> None:
        """Before a step: the leaves take the gradients the user left on the parameters."""
        if not self.distributed:
            return
        for name, p in self.params.items():
            leaf = self.leaves[name]
            if p.requires_grad != leaf.requires_grad:
                raise RuntimeError(
                    f"requires_grad of parameter {name} changed after parallelize; freeze or "
                    "unfreeze parameters before parallelize (the plan prices and synchronizes "
                    "gradients of the parameters that train)")
            if p._backward_hooks or p._post_accumulate_grad_hooks:
                raise RuntimeError(gradient_hook_message(name))
            g = p.grad
            if name in self.zero:  # the shard's gradient; the leaf's is reduce-scattered into it
                self.zero[name].grad = None if g is None else g.to_local()
                leaf.grad = None
                continue
            leaf.grad = None if g is None else g.to_local()

    def push_grads(self) -> None:
        """After a step: the parameters' gradients are the leaves', with their placements."""
        if not self.distributed:
            return
        for name, p in self.params.items():
            z = self.zero.get(name)
            g = self.leaves[name].grad if z is None else z.grad
            p.grad = None if g is None else DTensor.from_local(
                g, self.mesh, self.user_placements(name), run_check=False)
