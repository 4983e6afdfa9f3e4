"""Placing parameters: once, at a parallelized model's first build, rank 0's parameters and
buffers are broadcast (every rank starts from one model, as with DistributedDataParallel; a
meta model is initialized module by module, autopar/materialize.py) and each rank keeps its
block of each parameter, as the plan stores it, in a ParameterStore under the model's names
(runtime/params.py), and every buffer whole. The user's model then holds these tensors
(autopar/originals.py) and its full tensors are freed. Gradients are synchronized by a
GradSync (runtime/grad_sync.py) over the replicated mesh dimensions, with ZeRO's sharded
parameters (runtime/zero.py) synced by reduce-scatter. Later builds (another shape, eval
mode) are planned with the parameters where they are stored.

Also here: the constants a program reads (the placed buffers, and lifted constants broadcast
from rank 0), and a buffer the user rebinds on the parallelized model copied back into the one
the programs read.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from autopar.passes.torch_compat import persistent_buffers
from autopar.passes.trace import TracedProgram
from autopar.passes.zero import zero_shard
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.params import ParameterStore, local_block, skeleton_child
from autopar.runtime.zero import ZeroSync

from .context import BuildContext
from .guards import put_back
from .materialize import broadcast_from_rank0, local_values
from .originals import as_given
from .plan import Plan


def place_parameters(ctx: BuildContext, tree: nn.Module, plan: Plan) -> None:
    """Place the parameters as `plan` stores them (replicated where it does not say) on the
    whole mesh, into `tree` (the parallelized model), with their gradients' synchronization
    (ZeRO's reduce-scatter for those the plan shards so)."""
    setting = ctx.setting
    mesh_shape = tuple(setting.spec.shape)
    replicated = tuple(Replicate() for _ in mesh_shape)
    shapes = {n: tuple(p.shape) for n, p in ctx.source.named_parameters()}
    placements = {n: tuple(plan.parameters.get(n, replicated)) for n in shapes}
    zero = {n: (stage, zero_shard(shapes[n], placements[n], mesh_shape))
            for n, stage in plan.zero.items()}
    place(ctx, tree, placements, setting.mesh, mesh_shape, setting.coords, zero)
    ctx.grad_sync = gradient_sync(ctx, placements, zero)


def gradient_sync(ctx: BuildContext, placements: dict[str, tuple], zero: dict) -> GradSync:
    """The gradient synchronization of the placed parameters (`ctx.store`) that train:
    summed over the mesh dimensions each is replicated on, ZeRO's sharded ones
    reduce-scattered."""
    setting, store = ctx.setting, ctx.store
    groups, bucket = setting.comm.groups, setting.options.bucket_bytes
    trained = [(leaf, tuple(k for k, p in enumerate(placements[n])
                            if isinstance(p, Replicate)))
               for n, leaf in store.leaves.items() if leaf.requires_grad and n not in zero]
    sharded = ZeroSync([(store.leaves[n], z) for n, z in store.zero.items()
                        if store.leaves[n].requires_grad], groups, bucket) if zero else None
    return GradSync(trained, groups, tuple(setting.spec.shape), bucket, zero=sharded)


def place(ctx: BuildContext, tree: nn.Module, placements: dict[str, tuple], mesh, mesh_shape,
          coords, zero: dict | None = None) -> None:
    """Rank 0's parameters and buffers, broadcast (every rank starts from one model): this
    rank keeps its block, at mesh `coords`, of each parameter in `placements` (in that
    order: the order gradients are bucketed in, the same on every rank) in a
    ParameterStore over `mesh` (`ctx.store`), and every buffer whole (`ctx.buffers`); all
    registered on `tree` under the model's names. The full model is not referenced
    afterwards: the user's model holds `tree`'s tensors."""
    setting, model = ctx.setting, ctx.source
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def keep(name, whole):
        if name in placements:
            return local_block(whole, placements[name], mesh_shape, coords)
        return whole.clone() if name in buffers else None

    with as_given(model):  # (its own class's methods initialize it, module by module)
        local = setting.agree.on_every_rank("initializing the parameters", lambda: local_values(
            model, keep, setting.device, broadcast_group(ctx), setting.init_fn))
    ctx.store = ParameterStore(
        mesh, placements, {n: local[n] for n in placements},
        {n: params[n].requires_grad for n in placements}, ctx.aliases, zero,
        setting.options.bucket_bytes)
    ctx.store.register(tree)
    persistent = persistent_buffers(model)
    for name in buffers:
        owner, last = skeleton_child(tree, name)
        owner.register_buffer(last, local[name], persistent=name in persistent)
        ctx.buffers[name] = local[name]
    ctx.source = None
    ctx.original.built(tree)  # the model's tensors are these from now on


def broadcast_group(ctx: BuildContext):
    """The group rank 0's tensors are broadcast over: the gloo control group on CPUs (the
    default group otherwise)."""
    setting = ctx.setting
    return setting.agree.control.group if setting.device.type == "cpu" else None


def constants(ctx: BuildContext, program: TracedProgram) -> dict[str, torch.Tensor]:
    """The program's buffers (placed once) and lifted constants (rank 0's), by placeholder;
    a lifted constant is copied again when the user's tensor changes in place."""
    out, lifted = {}, {}
    for ph, key in program.buffers.items():
        if key.startswith("constant:"):
            lifted[ph] = program.constants[key].to(ctx.setting.device)
        else:
            out[ph] = ctx.buffers[key]
    copies = broadcast_from_rank0(lifted, lambda n, t: t.clone(), broadcast_group(ctx))
    for ph, copy in copies.items():
        ctx.guards.follow(program.constants[program.buffers[ph]], copy)
    out.update(copies)
    return out


def rebound_buffers(ctx: BuildContext, tree: nn.Module, moved: list) -> str | None:
    """A buffer replaced on the parallelized model `tree` (`pmodel.mask = new`,
    register_buffer again) since the programs took it: its values are copied into the tensor
    the programs read, which takes its place again (and joins `moved`: ranks must agree on
    it); an error message if it cannot be (removed, or another shape or dtype)."""
    for name, whole in ctx.buffers.items():
        owner, last = skeleton_child(tree, name)
        now = owner._buffers.get(last)
        if now is not whole:
            error = put_back(whole, now, f"buffer {name}")
            if error:
                return error
            owner._buffers[last] = whole
            moved.append(whole)
    return None
