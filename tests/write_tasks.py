"""What the gloo ranks run for tests/test_activation_writes.py: a model that writes into its
activations in place, through views, trained under a plan against one device."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests.rank_tasks import check_training, mesh_for


class ActivationWrites(nn.Module):
    """An MLP whose forward writes into its activations the ways models do: a scaled slice
    (`h[:, :4] *= 2`), a column set to a value, a narrowed block scaled in place, the first
    rows shifted, padding columns masked by a tensor of indices, a mask built in place, writes
    through a transpose and a reshaped view, and a tensor scaled in place read through a view
    taken before."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.register_buffer("pad", torch.tensor([3, 7]))

    def forward(self, x):
        h = self.a(x)
        h[:, :4] *= 2
        h[:, 5] = -1.0
        h.narrow(1, 8, 4).mul_(3)
        h[:2] += 1
        h[:, self.pad] = -5.0
        mask = torch.zeros_like(h)
        mask[:, :24] = 1.0
        h = h * mask
        g = self.b(h)
        t = g.t()
        t[0] += 5
        t[1:3].mul_(0.5)
        v = g.view(g.shape[0], 4, 8)
        v[:, 1] *= 0.3
        before = g[:, :8]
        g.mul_(1.5)
        g[:, 8:16] += before
        return self.c(g)


def train(mesh_shape, force=None) -> None:
    """Train ActivationWrites for 2 AdamW steps against one device (float64): losses,
    gradients, parameters and the inference output equal."""
    torch.manual_seed(0)
    model = ActivationWrites().double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.mse_loss,
                             example_inputs=(x, y), force=force)
    check_training(pm, ref, F.mse_loss, x, y, steps=2)
