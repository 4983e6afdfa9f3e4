"""ParallelModule: runs a plan's local programs on one rank.

It owns this rank's shards of the parameters (what an optimizer steps), feeds the local
programs, seeds the backward pass according to where the loss lives, synchronizes the gradients
of replicated parameters, and reassembles full tensors on request.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate

from autopar.passes.placement import Placements, R, local_slices
from autopar.passes.rewrite import LocalPrograms
from autopar.solver.reshard import plan_steps

from .collectives import MeshComm
from .grad_sync import GradSync, PendingSum


class ParallelModule(nn.Module):
    """The parallelized model on one rank: `step(*inputs, target)` trains, `__call__` infers."""

    def __init__(self, plan, programs: LocalPrograms, placeholder_kinds: dict[str, str],
                 param_names: dict[str, str], full_params: dict[str, torch.Tensor],
                 constants: dict[str, torch.Tensor], comm: MeshComm, coords: tuple[int, ...],
                 out_spec, num_inputs: int, has_loss: bool):
        super().__init__()
        self.plan = plan
        self._programs = programs
        self._kinds = placeholder_kinds
        self._param_of = param_names          # placeholder -> parameter name
        self._constants = constants           # placeholder -> tensor
        self._comm = comm
        self._coords = coords
        self._out_spec = out_spec
        self._num_inputs = num_inputs
        self._has_loss = has_loss
        mesh_shape = plan.mesh.shape
        self._shards = nn.ParameterList()
        self._by_name: dict[str, nn.Parameter] = {}
        for name, full in full_params.items():
            p = local_shard(full, plan.parameters[name], mesh_shape, coords)
            self._shards.append(p)
            self._by_name[name] = p
        replicated = [(p, tuple(k for k, pl in enumerate(plan.parameters[n])
                                if isinstance(pl, Replicate)))
                      for n, p in self._by_name.items()]
        self._grad_sync = GradSync(replicated, comm.groups, mesh_shape)
        loss = programs.loss_placement
        self._loss_seed = 1.0 if loss is None else 1.0 / math.prod(
            mesh_shape[k] for k, p in enumerate(loss) if isinstance(p, Replicate))
        self._loss_partial_dims = [] if loss is None else [
            k for k, p in enumerate(loss) if isinstance(p, Partial)]

    # -- parameters ----------------------------------------------------------------------------
    def named_local_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's shard of every parameter, by the model's parameter names."""
        return dict(self._by_name)

    def _feed(self, inputs: tuple, target=None, train: bool = True) -> list:
        args = []
        user = list(inputs) + ([target] if train and self._has_loss else [])
        it = iter(user)
        for name in self._programs.placeholders:
            kind = self._kinds[name]
            if kind == "param":
                args.append(self._by_name[self._param_of[name]])
            elif kind == "constant":
                args.append(self._constants[name])
            else:
                if not train and self._has_loss and name == self._programs.placeholders[-1]:
                    continue
                args.append(next(it))
        return args

    def _check_inputs(self, inputs: tuple) -> None:
        if len(inputs) != self._num_inputs:
            raise TypeError(f"expected {self._num_inputs} model input(s) as traced, got "
                            f"{len(inputs)}")

    # -- running -------------------------------------------------------------------------------
    def step(self, *inputs) -> torch.Tensor:
        """Forward and backward on the global batch; returns the loss (the same on every rank).

        Gradients of the local parameter shards are complete when this returns: an optimizer
        over `parameters()` can step.
        """
        if self._programs.train is None:
            raise RuntimeError("this model was planned without a loss; pass loss_fn= to "
                               "parallelize (or a model whose output is the loss)")
        if self._has_loss:
            *inputs, target = inputs
        else:
            target = None
        self._check_inputs(tuple(inputs))
        (loss,) = self._programs.train(*self._feed(tuple(inputs), target))
        # the loss value is summed for reporting while backward runs (in a gradient bucket)
        report = PendingSum(loss, self._comm.groups, self._loss_partial_dims)
        self._grad_sync.begin(report)
        loss.backward(torch.full_like(loss, self._loss_seed))
        self._grad_sync.finish()
        return report.wait()

    def forward(self, *inputs):
        """Inference on the global batch: returns what the original model returns, whole.

        Runs without autograd; train through `step`, which seeds the backward pass correctly.
        """
        self._check_inputs(inputs)
        with torch.no_grad():
            flat = self._programs.infer(*self._feed(inputs, train=False))
        from torch.utils import _pytree as pytree
        return pytree.tree_unflatten(list(flat), self._out_spec)

    # -- whole tensors, for checking and checkpoints -------------------------------------------
    def _whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        storage: Placements = self.plan.parameters[name]
        mesh_shape = self.plan.mesh.shape
        return gather_whole(t, _global_shape(t.shape, storage, mesh_shape), storage, mesh_shape,
                            self._comm)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call on all ranks)."""
        return {n: self._whole(n, p) for n, p in self._by_name.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient reassembled whole (a collective: call on all ranks)."""
        return {n: self._whole(n, p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in self._by_name.items()}


def local_shard(full: torch.Tensor, storage: Placements, mesh_shape, coords) -> nn.Parameter:
    """This rank's block (at mesh `coords`) of parameter `full` stored at `storage`, as a new
    parameter."""
    block = full.detach()
    for d, (start, length) in enumerate(local_slices(full.shape, storage, mesh_shape, coords)):
        block = block.narrow(d, start, length)
    return nn.Parameter(block.clone(), requires_grad=full.requires_grad)


def gather_whole(t: torch.Tensor, shape, storage: Placements, mesh_shape,
                 comm: MeshComm) -> torch.Tensor:
    """The whole tensor of global `shape` from this rank's block `t` stored at `storage`
    (all-gathers over the mesh: a collective)."""
    with torch.no_grad():
        x = t.detach()
        for s in plan_steps(shape, storage, tuple(R for _ in storage), mesh_shape):
            x = comm.all_gather(x, s.dim, s.mesh_dim)
    return x


def _global_shape(shape, placements, mesh_shape) -> tuple:
    out = list(shape)
    for k, p in enumerate(placements):
        if hasattr(p, "dim") and not isinstance(p, (Replicate, Partial)):
            out[p.dim] *= mesh_shape[k]
    return tuple(out)
