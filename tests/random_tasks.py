"""Rank tasks for the counter mode of randomness: a model with dropout and noise trained under
several plans, whose losses and parameters the test compares across plans and meshes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autopar
from tests import pipeline_tasks, rank_tasks


def counter_training(name: str, shape: tuple[int, ...], names: tuple[str, ...],
                     runs: list[dict], steps: int = 2) -> list[dict] | None:
    """For each of `runs` (autopar.parallelize options: force, microbatches, schedule), a
    fresh float64 copy of model `name` planned with randomness="counter" on the mesh `shape`
    (dimensions `names`) trains `steps` AdamW steps, every rank seeded alike before each.
    Returns on rank 0, per run: the plan's randomness, accumulation and pipeline
    microbatches, the losses and the parameters after the steps (whole); None elsewhere."""
    model, loss_fn, (x, y) = rank_tasks.build(name)
    model, (x, y) = rank_tasks.in_float64(model, (x, y))
    mesh = pipeline_tasks.mesh_for(shape, names)
    out = []
    for options in runs:
        pm = autopar.parallelize(copy.deepcopy(model), mesh, loss_fn=loss_fn,
                                 example_inputs=(x, y), randomness="counter", **options)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-5)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            torch.manual_seed(100 + step)
            losses.append(float(pm.step(x, y)))
            opt.step()
        plan = pm.plan
        out.append({"randomness": plan.randomness, "accumulation": plan.accumulation,
                    "pipeline": plan.pipeline.microbatches if plan.pipeline else None,
                    "losses": losses,
                    "parameters": {k: v.detach().clone()
                                   for k, v in pm.full_parameters().items()}})
    return out if dist.get_rank() == 0 else None
